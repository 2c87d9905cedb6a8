"""Running statistics updated by each rank's own batches, combined as one process updates them.

[Note: what one process does]
One process running several batches that are each normalised by their own statistics (the
tasks of a meta-batch, one after another; or micro-batches accumulated into one step)
updates a BatchNorm's running statistics once per batch, in turn:
``r <- (1 - m) r + m s`` with ``s`` that batch's mean and unbiased variance (or, for
``momentum=None``, the cumulative average over every batch so far). On several ranks each
rank runs its own batches. The distributed equivalent metadist keeps is **one process
running the ranks' batches in rank order**: rank 0's, in its order, then rank 1's, and so on
(what a meta-batch split into contiguous slices, as ``setup_dataloader`` and
``tensor_split`` split it, runs in one process).

[Note: how]
Such a forward normalises by its batch's statistics without touching the running
statistics; the update it would have made is folded into this rank's record of the layer
instead, an affine map ``r -> A r + B`` (``A`` the product of the ``1 - m``, ``B`` a vector),
or for ``momentum=None`` a count and a sum. At the optimizer's step (the step chain's
``"running_stats"`` phase) or :meth:`RunningStats.sync`, the ranks exchange their records
in one all-gather and every rank applies them in rank order to the values all ranks share,
so the buffers agree across ranks and equal one process's. Nothing is exchanged when no
rank recorded anything (one small all-reduce says so). Records stay on the device: no host
synchronisation per forward.

Between two steps a rank's buffers hold the values of the last step; a forward that reads
them (evaluation mode) while updates are recorded and not yet combined stops and says to
combine them first, since one process would read values that include the other ranks'
batches. The same layer updated both ways between two steps (the global batch's statistics
with ``sync_batchnorm=True`` and a rank's own batch) has no one-process order and stops too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from metadist.comm import ops


@dataclass(eq=False)
class _Slot:
    """One tensor of running statistics and this rank's record since the last combination."""

    name: str
    tensor: Tensor
    cumulative: bool = False  # momentum=None: the average over every batch so far
    count: Tensor | None = None  # its layer's num_batches_tracked
    owns_count: bool = False  # this slot writes the count back (the layer's running_mean)
    scale: float = 1.0  # A (affine), or the number of batches (cumulative)
    offset: Tensor | None = None  # B (affine), or the sum of the batches' statistics
    counted: Tensor | None = None  # this rank's own batches' increments of count
    seen: Tensor | None = None  # count when last looked at
    pending: bool = False
    global_updates: bool = False  # updated by the global batch since the last combination

    def fold(self, stats: Tensor, factor: float) -> None:
        if self.offset is None:  # kept from then on, zeroed at each combination
            self.offset = torch.zeros(self.tensor.numel(), dtype=torch.float64,
                                      device=self.tensor.device)
        if self.cumulative:
            self.scale += 1.0
            self.offset.add_(stats.reshape(-1))
        else:
            self.scale *= 1.0 - factor
            self.offset.mul_(1.0 - factor).add_(stats.reshape(-1), alpha=factor)
        if self.count is not None:
            assert self.counted is not None and self.seen is not None
            self.counted.add_(self.count - self.seen)
            self.seen.copy_(self.count)
        self.pending = True


class _Records:
    """The records of some slots, laid out as one float64 vector (``[scales, count
    increments, offsets]``) to exchange, and combined for all of them at once."""

    def __init__(self, slots: list[_Slot], device: torch.device) -> None:
        self.slots = slots
        self.sizes = [s.tensor.numel() for s in slots]
        for slot in slots:
            if slot.count is not None and slot.counted is None:
                slot.counted = torch.zeros((), dtype=torch.float64, device=device)
                slot.seen = slot.count.detach().to(torch.float64)
        self.expand = torch.repeat_interleave(torch.arange(len(slots), device=device),
                                              torch.tensor(self.sizes, dtype=torch.long,
                                                           device=device))
        self.cumulative = torch.tensor([s.cumulative for s in slots], device=device)[
            self.expand]
        self.counted = [s for s in slots if s.count is not None]

    def record(self) -> Tensor:
        device = self.expand.device
        offsets = [s.offset if s.offset is not None else
                   torch.zeros(s.tensor.numel(), dtype=torch.float64, device=device)
                   for s in self.slots]
        counted = [s.counted.reshape(1) if s.counted is not None else
                   torch.zeros(1, dtype=torch.float64, device=device) for s in self.slots]
        return torch.cat([torch.tensor([s.scale for s in self.slots], dtype=torch.float64,
                                       device=device), *counted, *offsets])

    @torch.no_grad()
    def apply(self, everyone: list[Tensor]) -> None:
        """Every rank's record (as :meth:`record` lays it out), combined in rank order into
        the values all ranks share."""
        n, expand = len(self.slots), self.expand
        value = torch.cat([s.tensor.detach().reshape(-1).to(torch.float64)
                           for s in self.slots])
        count = torch.zeros(n, dtype=torch.float64, device=expand.device)
        for i, slot in enumerate(self.slots):  # the count all ranks share: less this rank's
            if slot.count is not None:
                assert slot.counted is not None
                count[i] = slot.count.to(torch.float64) - slot.counted
        for record in everyone:
            scale, counted, offset = record[:n], record[n:2 * n], record[2 * n:]
            total = count + scale
            averaged = torch.where((total > 0)[expand],
                                   (count[expand] * value + offset) / total.clamp(min=1)[expand],
                                   value)
            value = torch.where(self.cumulative, averaged, scale[expand] * value + offset)
            count = count + counted
        # .data: an update of running statistics, which autograd does not version (torch's
        # kernels update them likewise), so graphs that saved a tensor stay valid
        torch._foreach_copy_([s.tensor.data for s in self.slots],
                             [v.view(s.tensor.shape) for v, s in
                              zip(value.split(self.sizes), self.slots, strict=True)])
        owners = [(i, s) for i, s in enumerate(self.slots) if s.owns_count]
        if owners:
            torch._foreach_copy_([s.count.data for _, s in owners if s.count is not None],
                                 [count[i].round() for i, _ in owners])

    def reset(self) -> None:
        offsets = [s.offset for s in self.slots if s.offset is not None]
        if offsets:
            torch._foreach_zero_(offsets)
        if self.counted:
            torch._foreach_zero_([s.counted for s in self.counted])  # type: ignore[misc]
            torch._foreach_copy_([s.seen for s in self.counted],  # type: ignore[misc]
                                 [s.count for s in self.counted])  # type: ignore[misc]
        for slot in self.slots:
            slot.scale = 0.0 if slot.cumulative else 1.0
            slot.pending = slot.global_updates = False


class RunningStats:
    """The running statistics a set-up model's normalisations may update (its floating
    buffers and frozen parameters: torch's BatchNorm layers, metadist's SyncBatchNorm, a
    functional learner's own), and each rank's record of its own batches' updates (module
    notes). The slots are the model's, in its order, the same on every rank."""

    def __init__(self, root: nn.Module | None) -> None:
        self._slots: list[_Slot] = []
        self._by_id: dict[int, _Slot] = {}
        if root is None:
            return
        named = [*root.named_buffers(), *((n, p) for n, p in root.named_parameters()
                                          if not p.requires_grad)]
        for name, t in named:  # (a sharding strategy's frozen parameters are not here)
            if t.is_floating_point() and not t.is_meta and id(t) not in self._by_id:
                slot = _Slot(name, t)
                self._slots.append(slot)
                self._by_id[id(t)] = slot
        for module in root.modules():  # torch's layers: their count and momentum=None
            if not isinstance(module, _BatchNorm) or not module.track_running_stats:
                continue
            count = module.num_batches_tracked
            for i, stat in enumerate((module.running_mean, module.running_var)):
                found = self._slot(stat)
                if found is not None:
                    found.count, found.owns_count = count, i == 0
                    found.cumulative = module.momentum is None
        #: the BatchNorm layers' statistics, exchanged at every combination; the others
        #: (a program's own normalisation) only where a rank recorded into them
        device = self._slots[0].tensor.device if self._slots else torch.device("cpu")
        self._layers = _Records([s for s in self._slots if s.count is not None], device)
        self._layers.reset()
        for slot in self._slots:
            slot.scale = 0.0 if slot.cumulative else 1.0

    def __bool__(self) -> bool:
        return bool(self._slots)

    def _slot(self, t: Tensor | None) -> _Slot | None:
        slot = None if t is None else self._by_id.get(id(t))
        return slot if slot is not None and slot.tensor is t else None

    def updates(self, running_mean: Tensor | None, running_var: Tensor | None) -> bool:
        """Whether both running statistics are this model's (their updates can be
        combined)."""
        return self._slot(running_mean) is not None and self._slot(running_var) is not None

    def holds(self, t: Tensor) -> bool:
        """Whether ``t`` is a BatchNorm layer's running statistics or count, which this
        record keeps equal on every rank (a broadcast from one rank would overwrite a count
        of this rank's own batches)."""
        slot = self._slot(t)
        return (slot is not None and slot.count is not None) or any(
            t is s.count for s in self._slots)

    # ----- during forwards ------------------------------------------------------------------
    def record(self, running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor,
               factor: float) -> None:
        """Fold the update a normalisation by its own batch's ``mean`` and unbiased ``var``
        makes, with update weight ``factor``, into this rank's record."""
        slots = [self._slot(running_mean), self._slot(running_var)]
        for slot in slots:
            assert slot is not None
            if slot.global_updates:
                raise RuntimeError(_mixed(slot.name))
        for slot, stats in zip(slots, (mean, var), strict=True):
            assert slot is not None
            slot.fold(stats.detach().to(torch.float64), factor)

    def global_update(self, *running: Tensor | None) -> None:
        """Running statistics are being updated from the global batch, the same on every
        rank (``sync_batchnorm=True``)."""
        for t in running:
            slot = self._slot(t)
            if slot is None:
                continue
            if slot.pending:
                raise RuntimeError(_mixed(slot.name))
            slot.global_updates = True
            if slot.count is not None and slot.seen is not None:
                slot.seen.copy_(slot.count)

    def check_read(self, *running: Tensor | None) -> None:
        """A forward reads these running statistics (evaluation)."""
        for t in running:
            slot = self._slot(t)
            if slot is not None and slot.pending:
                raise RuntimeError(
                    f"'{slot.name}' is read as running statistics while this rank's batches "
                    "since the last optimizer step have updates to it that are not yet "
                    "combined with the other ranks' (one process would read values that "
                    "include every rank's batches). Evaluate after optimizer.step(), or call "
                    "model.sync_running_stats() on every rank first")

    # ----- combining --------------------------------------------------------------------------
    def sync(self) -> None:
        """Combine every rank's records in rank order into the running statistics (every
        rank calls it: collective). One all-gather carries which slots each rank recorded
        into and the records of the BatchNorm layers' statistics; a second one, only where a
        rank recorded into other slots (a program's own normalisation), carries theirs."""
        if not self._slots:
            return
        flags = torch.tensor([float(s.pending) for s in self._slots], dtype=torch.float64)
        first = self._gather(torch.cat([flags.to(self._layers.expand.device),
                                        self._layers.record()]))
        touched = torch.stack([t[:len(self._slots)] for t in first]).amax(0).tolist()
        hit = {id(s) for s, flag in zip(self._slots, touched, strict=True) if flag > 0}
        if any(id(s) in hit for s in self._layers.slots):
            self._layers.apply([t[len(self._slots):] for t in first])
        others = _Records([s for s in self._slots if s.count is None and id(s) in hit],
                          self._layers.expand.device)
        if others.slots:
            others.apply(self._gather(others.record()))
            others.reset()
        self._layers.reset()
        for slot in self._slots:
            slot.pending = slot.global_updates = False

    def _gather(self, mine: Tensor) -> list[Tensor]:
        """Every rank's ``mine`` (float64, the same length on every rank), in rank order."""
        size = ops.group_info(None)[1]
        gathered = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
        ops.all_gather(gathered, mine)
        return list(gathered.chunk(size))


def _mixed(name: str) -> str:
    return (f"'{name}' updates its running statistics both from the global batch "
            "(sync_batchnorm=True) and from a rank's own batch (a per-rank task) between two "
            "optimizer steps; one process has no single order for the two. Combine them "
            "first (model.sync_running_stats() on every rank, or optimizer.step()), or build "
            "the layer the per-rank computation uses with track_running_stats=False")


#: each watched root's running statistics (strategies/batchnorm/calls.py)
LEDGERS: weakref.WeakKeyDictionary[nn.Module, RunningStats] = weakref.WeakKeyDictionary()
