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

    def reset(self) -> None:
        self.scale = 0.0 if self.cumulative else 1.0
        self.offset = None
        if self.count is not None:
            self.counted = torch.zeros((), dtype=torch.float64, device=self.count.device)
            self.seen = self.count.detach().clone()
        self.pending = self.global_updates = False

    def fold(self, stats: Tensor, factor: float) -> None:
        if self.offset is None:
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

    def record(self) -> Tensor:
        """[scale, count increments, offset...] in float64 on the tensor's device."""
        device = self.tensor.device
        offset = (self.offset if self.offset is not None
                  else torch.zeros(self.tensor.numel(), dtype=torch.float64, device=device))
        counted = (self.counted.reshape(1) if self.counted is not None
                   else torch.zeros(1, dtype=torch.float64, device=device))
        scale = torch.full((1,), self.scale, dtype=torch.float64, device=device)
        return torch.cat([scale, counted, offset])

    def shared_count(self) -> Tensor | None:
        """The count every rank shares: this rank's, less its own batches' increments."""
        if self.count is None:
            return None
        assert self.counted is not None
        return self.count.to(torch.float64) - self.counted

    @torch.no_grad()
    def apply(self, records: list[Tensor], count: Tensor | None) -> None:
        """Combine every rank's record, in rank order, into the shared value (``count``:
        :meth:`shared_count`, taken before any slot of the layer was written)."""
        value = self.tensor.detach().reshape(-1).to(torch.float64)
        for record in records:
            scale, counted, offset = record[0], record[1], record[2:]
            if self.cumulative and count is not None:
                total = count + scale
                value = torch.where(total > 0, (count * value + offset) / total.clamp(min=1),
                                    value)
            elif not self.cumulative:
                value = scale * value + offset
            if count is not None:
                count = count + counted
        # .data: an update of running statistics, which autograd does not version (torch's
        # kernels update them likewise), so graphs that saved the tensor stay valid
        self.tensor.data.copy_(value.reshape(self.tensor.shape))
        if self.owns_count and self.count is not None and count is not None:
            self.count.data.copy_(count.round().to(self.count.dtype))


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
        for slot in self._slots:
            slot.reset()

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
    def record(self, running_mean: Tensor, running_var: Tensor, x: Tensor,
               factor: float) -> None:
        """Fold the update a normalisation of ``x`` (channels in dim 1) by its own
        statistics makes, with update weight ``factor``, into this rank's record."""
        slots = [self._slot(running_mean), self._slot(running_var)]
        for slot in slots:
            assert slot is not None
            if slot.global_updates:
                raise RuntimeError(_mixed(slot.name))
        dims = [0, *range(2, x.dim())]
        data = x.detach()
        if data.dtype not in (torch.float32, torch.float64):
            data = data.float()
        var, mean = torch.var_mean(data, dims, correction=1)
        for slot, stats in zip(slots, (mean, var), strict=True):
            assert slot is not None
            slot.fold(stats.to(torch.float64), factor)

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
        and the records of the BatchNorm layers' statistics; a second one, only where a rank
        recorded into other slots (a program's own normalisation), carries theirs."""
        if not self._slots:
            return
        layers = [s for s in self._slots if s.count is not None]
        first = self._gather([torch.tensor([float(s.pending) for s in self._slots],
                                           dtype=torch.float64), *(s.record() for s in layers)])
        flags = torch.stack([t[:len(self._slots)] for t in first]).amax(0).tolist()
        touched = {id(s) for s, flag in zip(self._slots, flags, strict=True) if flag > 0}
        if touched:
            self._apply([s for s in layers if id(s) in touched],
                        [t[len(self._slots):] for t in first], layers)
            others = [s for s in self._slots if s.count is None and id(s) in touched]
            if others:
                self._apply(others, self._gather([s.record() for s in others]), others)
        for slot in self._slots:
            slot.reset()

    def _gather(self, parts: list[Tensor]) -> list[Tensor]:
        """Every rank's concatenation of ``parts`` (float64), in rank order."""
        device = self._slots[0].tensor.device
        mine = torch.cat([p.to(device) for p in parts])
        size = ops.group_info(None)[1]
        gathered = torch.empty(size * mine.numel(), dtype=mine.dtype, device=device)
        ops.all_gather(gathered, mine)
        return list(gathered.chunk(size))

    @staticmethod
    def _apply(which: list[_Slot], everyone: list[Tensor], laid: list[_Slot]) -> None:
        """Apply the records of ``which`` from ``everyone`` (each rank's records of the
        slots ``laid``, in that order)."""
        at, offsets = 0, {}
        for slot in laid:
            offsets[id(slot)] = at
            at += 2 + slot.tensor.numel()
        counts = [slot.shared_count() for slot in which]  # before any slot writes its count
        for slot, count in zip(which, counts, strict=True):
            start, width = offsets[id(slot)], 2 + slot.tensor.numel()
            slot.apply([t[start:start + width] for t in everyone], count)


def _mixed(name: str) -> str:
    return (f"'{name}' updates its running statistics both from the global batch "
            "(sync_batchnorm=True) and from a rank's own batch (a per-rank task) between two "
            "optimizer steps; one process has no single order for the two. Combine them "
            "first (model.sync_running_stats() on every rank, or optimizer.step()), or build "
            "the layer the per-rank computation uses with track_running_stats=False")


#: each watched root's running statistics (strategies/batch_norm_calls.py)
LEDGERS: weakref.WeakKeyDictionary[nn.Module, RunningStats] = weakref.WeakKeyDictionary()
