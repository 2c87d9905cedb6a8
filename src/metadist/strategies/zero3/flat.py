"""Flat, padded, per-unit parameter shards (zero3, hsdp).

A :class:`FlatParam` holds the parameters of one wrap unit that share a dtype, an optimizer
group and ``requires_grad``: concatenated, padded to a multiple of the shard group's size,
and split so each rank keeps one contiguous shard (an ``nn.Parameter`` the optimizer steps).
Before the unit runs, the shards are all-gathered into a full buffer the module's parameters
are views of (no copies); after use the buffer's storage is freed and re-allocated on demand.

The full buffer enters autograd through :class:`_Unshard`, whose backward reduce-scatters the
gradient into the shard. With ``create_graph=True`` that backward is built from the
differentiable collectives, so double backward works; in a plain ``.backward()`` it runs
asynchronously (overlapping the next unit's backward) and is accumulated into ``shard.grad``
when the next one is launched or backward ends; inside ``torch.autograd.grad`` it returns the
gradient.
Writes into the full buffer go through ``.data`` so re-gathering for backward never trips
autograd's version checks on the tensors it saved.

Which parameters a gradient reached is recorded per slot (:class:`_Views`: the split into
parameter views is a node whose backward sees which views got a gradient); the record
travels with the gradient (no_sync's stash, the deferred reduce-scatter) into
:attr:`FlatParam.reached`, "has a gradient" per parameter, which strategies/zero3/unreached.py
turns into one process's ``grad=None`` at the optimizer step.

Graphs that no unit hook re-gathers for (``full_parameters()``, the parameters
``functional_forward`` fills in) get :meth:`FlatParam.owned`: a gathered copy of their own
behind :class:`_UnshardOwned`, shared by the calls until the next optimizer step. No forward
or backward in between can free it, and a graph kept with ``retain_graph`` can run again.

The buffer is kept while anyone claims it: its unit (strategies/zero3/unit_state.py), unshards
still to be backpropagated (``live``), a pin (:meth:`FlatParam.pin`, by the backward holds).
Each claim changes only through its owner's methods; :meth:`FlatParam.after_step` voids the
flat's own when the shard changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from metadist.comm import functional, ops
from metadist.comm.handle import Handle
from metadist.runtime.world import SELF, Group
from metadist.strategies.bind import place_of
from metadist.strategies.buckets import will_accumulate
from metadist.strategies.placement import flat_part, paste
from metadist.strategies.tensors.shard_value import ShardParameter
from metadist.strategies.tensors.whole_reductions import Span
from metadist.strategies.zero3.backward_coordinator import BackwardCoordinator
from metadist.strategies.zero3.shard_grads import refuse_shard_grad, shard_grads_allowed


@dataclass(frozen=True)
class Slot:
    """Where one original parameter lives in its flat buffer, and where it is used."""

    fqn: str
    uses: tuple[tuple[nn.Module, str], ...]  # (module, attribute); several for tied weights
    shape: torch.Size
    offset: int
    numel: int
    aliases: tuple[str, ...] = ()  # further names of a tied parameter (state_dict keys)


class FlatParam:
    """One unit's parameters of one dtype/group: a padded flat buffer sharded over ``group``."""

    def __init__(self, slots: list[Slot], originals: list[nn.Parameter], *, group: Group,
                 replicate_group: Group, device: torch.device, offload: bool,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 scale: Callable[[], float], coordinator: BackwardCoordinator) -> None:
        _, n, rank = ops.group_info(group)
        # ranks whose gradients are summed into a shard: the shard group times its replicas
        self.total = n * ops.group_info(replicate_group)[1]
        self.slots, self.originals = slots, originals
        self.group, self.replicate_group = group, replicate_group
        self.rank, self.size = rank, n
        self.numel = sum(s.numel for s in slots)
        self.padded = -(-self.numel // n) * n
        self.shard_size = self.padded // n
        self.device, self.offload = device, offload
        self.scale, self.coordinator = scale, coordinator
        dtype = originals[0].dtype
        self.compute_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        with torch.no_grad():
            # Only this rank's range is copied: the whole unit is never assembled a second
            # time (setup's peak, and a deferred-init model's, stays one unit above shards).
            shard = torch.zeros(self.shard_size, dtype=dtype, device=device)
            for slot, p in zip(slots, originals, strict=True):
                for part in flat_part(shard, rank * self.shard_size, slot.offset, slot.numel):
                    paste(part, p.detach().reshape(-1)[part.start:part.stop])
            if offload:
                shard = shard.cpu().pin_memory() if device.type == "cuda" else shard.cpu()
        # what model.parameters() yields: element-wise arithmetic only (shard_value.py)
        self.shard = ShardParameter(shard, requires_grad=originals[0].requires_grad)
        valid = min(max(self.numel - rank * self.shard_size, 0), self.shard_size)
        self.shard._metadist_span = Span(group, valid, self.numel)  # type: ignore[attr-defined]
        self.full = torch.empty(self.padded, dtype=self.compute_dtype, device=device)
        #: per slot, what its module attributes hold while the buffer is freed (the
        #: strategy's placeholders, strategies/zero3/foreign_runs.py)
        self.placeholders: list[torch.Tensor] = []
        self._write = self.full.data  # own version counter: refills are invisible to autograd
        self._free()
        grad_fn = self.shard.view_as(self.shard).grad_fn if self.shard.requires_grad else None
        self.acc_node = grad_fn.next_functions[0][0] if grad_fn is not None else None
        self._handle: Handle | None = None
        self._filled_from = -1  # the shard's version the full buffer was gathered from
        self._staged: torch.Tensor | None = None
        # Claims on the buffer, each changed only by this object's methods:
        self._live = 0  # unshards (with grad) still to be backpropagated through this buffer
        self._pinned = False  # a recorded graph reads it again (pin/unpin): release() keeps it
        # (shard version, owned copy): shared by the calls until the shard changes. A strong
        # reference: whether a call gathers must not depend on when the garbage collector
        # ran on each rank.
        self._owned_copy: tuple[int, torch.Tensor] | None = None
        # the parameter views of that copy, one node for every graph built on them
        self._owned_views: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._stash: torch.Tensor | None = None  # unsharded gradients under no_sync
        self._sync_grads = True
        # Per slot, whether a gradient reached it: seen by the views' backward (pending),
        # kept with the no_sync stash, and in ``reached`` for the gradient ``shard.grad``
        # holds (reset when that starts afresh). See strategies/zero3/unreached.py.
        self._pending_reach: list[bool] | None = None
        # fast weights (strategies/zero3/sharded_fast.py): (graph task, slots its views reached)
        self._task_reach: tuple[int, list[bool]] | None = None
        self._stash_reach: list[bool] | None = None
        self.reached: list[bool] | None = None
        #: slots whose gradient was set to None alone (``p.grad = None``): sharded_param.py
        self.cleared: set[int] = set()
        #: Slots a step skipped whose optimizer state one process would hold otherwise than
        #: this shard does: slot index -> that state's per-parameter values (None: one
        #: process holds no state for it). Kept by strategies/zero3/unreached.py.
        self.skipped: dict[int, dict[str, Any] | None] = {}
        self._on_reduce: Callable[[], None] | None = None  # see set_on_reduce

    # ----- claims on the full buffer ------------------------------------------------
    @property
    def live(self) -> int:
        """Unshards (forward graphs with grad) not yet backpropagated through this buffer."""
        return self._live

    def pin(self) -> None:
        """A recorded graph reads this buffer again: :meth:`release` keeps it until unpin."""
        self._pinned = True

    def unpin(self) -> None:
        self._pinned = False

    def set_on_reduce(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after each plain backward through the unshard (zero3: its unit
        may end its backward once every flat has reduced)."""
        self._on_reduce = callback

    def set_sync_grads(self, enabled: bool) -> None:
        """``no_sync``: while disabled, gradients accumulate unsharded and are reduced with
        the next synchronised backward."""
        self._sync_grads = enabled

    def after_step(self) -> None:
        """The shard changed: every claim on the gathered buffer and the owned copy is void
        (graphs recorded before the step are not backpropagated again); free it."""
        self._live, self._pinned, self._owned_copy, self._owned_views = 0, False, None, None
        self._pending_reach = None
        self.release()

    # ----- gather and free ------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def _free(self) -> None:
        """Free the full buffer; module attributes still holding views of it get their
        placeholders back (reading a view of freed memory would read past its end)."""
        storage = self.full.untyped_storage()
        if self.placeholders and storage.size() > 0:
            ptr = storage.data_ptr()
            for slot, placeholder in zip(self.slots, self.placeholders, strict=True):
                for module, attr in slot.uses:
                    store, key = place_of(module, attr)
                    held = store.get(key)
                    if (isinstance(held, torch.Tensor) and not held.is_meta
                            and held.untyped_storage().data_ptr() == ptr):
                        store[key] = placeholder
        storage.resize_(0)

    def start_gather(self) -> bool:
        """Launch the all-gather of the full buffer; False (nothing to do) if it is present
        or in flight."""
        if self._handle is not None:
            return False
        if self.gathered:
            if self._filled_from == self.shard._version:
                return False
            # The shard changed since this buffer was filled (an optimizer the strategy never
            # saw stepped it, or an in-place edit): refill it, never compute on stale values.
        else:
            storage = self.full.untyped_storage()
            storage.resize_(self.padded * self.full.element_size())
        self._filled_from = self.shard._version
        with torch.no_grad():
            src = self.shard.detach()
            if src.device != self.device or src.dtype != self.compute_dtype:
                src = src.to(self.device, self.compute_dtype, non_blocking=True)
            self._staged = src  # keep alive until the gather finishes
            self._handle = ops.all_gather(self._write, src, group=self.group, async_op=True)
        return True

    def wait(self) -> None:
        """Finish a gather in flight, if any."""
        if self._handle is not None:
            self._handle.wait()
            self._handle, self._staged = None, None

    def wait_gather(self) -> None:
        self.start_gather()
        self.wait()

    def release(self) -> None:
        """Free the full buffer now (after any gather in flight lands), unless pinned."""
        self.wait()
        if self.gathered and not self._pinned:
            self._free()

    def maybe_free(self) -> None:
        """Free the full buffer unless a pending gather, a live graph or a pin needs it."""
        if self._live <= 0 and self._handle is None and self.gathered and not self._pinned:
            self._free()

    def unsharded(self, differentiable: bool) -> torch.Tensor:
        """The gathered full buffer; through :class:`_Unshard` when gradients should flow."""
        self.wait_gather()
        if differentiable and self.shard.requires_grad and torch.is_grad_enabled():
            self._live += 1
            out: torch.Tensor = _Unshard.apply(self.shard, self)
            return out
        return self.full.detach()

    def owned(self) -> torch.Tensor:
        """The full parameters in memory of their own (not the shared buffer): differentiable
        into the shard (through :class:`_UnshardOwned`) when gradients should flow. Calls
        between two changes of the shard (optimizer steps) share one copy, gathered once,
        which is kept until the shard changes or :meth:`after_step`; calls under no_grad get
        it detached."""
        differentiable = self.shard.requires_grad and torch.is_grad_enabled()
        if self._owned_copy is not None and self._owned_copy[0] == self.shard._version:
            kept = self._owned_copy[1]
            if not differentiable:
                return kept.detach()
            if kept.requires_grad:
                return kept
        out: torch.Tensor = (_UnshardOwned.apply(self.shard, self) if differentiable
                             else self._gather_copy())
        self._owned_copy = (self.shard._version, out)
        return out

    def owned_views(self) -> list[torch.Tensor]:
        """Parameter views of :meth:`owned`, the same tensors for every call that gets the
        same copy, as a module hands out the same parameters: gradients of several uses
        (one per task of a meta-batch) then add up per parameter in the order they would in
        one process; views taken afresh per call would add per call first, then across the
        calls, a different rounding."""
        full = self.owned()
        if self._owned_views is None or self._owned_views[0] is not full:
            self._owned_views = (full, self.views(full))
        return list(self._owned_views[1])

    def _gather_copy(self) -> torch.Tensor:
        """A fresh tensor holding the full buffer: copied if it is gathered (or on its
        way), else all-gathered into directly; the shared buffer is left as it was."""
        with torch.no_grad():
            if self.gathered:
                self.wait()
                return self.full.detach().clone()
            return self.gather_laid_out(self.shard.detach().to(self.compute_dtype))

    def gather_laid_out(self, local: torch.Tensor) -> torch.Tensor:
        """Collective: a fresh full (padded) tensor of every rank's ``local``, a tensor laid
        out like this rank's shard (the shard itself, a per-element optimizer state), in
        ``local``'s dtype. The one blocking gather of a flat: state dicts, consolidation and
        regrouping read whole values through it."""
        out = torch.empty(self.padded, dtype=local.dtype, device=self.device)
        with torch.no_grad():
            ops.all_gather(out, local.detach().as_subclass(torch.Tensor).to(self.device),
                           group=self.group)
        return out

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Parameter-shaped views of ``full``: one node in backward, which records which of
        them a gradient reached."""
        if full.requires_grad:
            # a parameter frozen after setup gets no gradient, as in one process, while the
            # rest of its flat trains (its slot reads as unreached: the step skips it)
            return [v if p.requires_grad else v.detach() for v, p in
                    zip(_Views.apply(full, self), self.placeholders, strict=True)]
        return split_views(full, self)

    def note_reached(self, mask: list[bool], fast: bool = False) -> None:
        """A backward through :meth:`views` reached the slots ``mask`` marks."""
        if not fast:
            self._pending_reach = _union(self._pending_reach, mask)
            return
        task, known = torch._C._current_graph_task_id(), self._task_reach
        if known is not None and known[0] == task:
            mask = [a or b for a, b in zip(known[1], mask, strict=True)]
        self._task_reach = (task, mask)

    def task_reached(self) -> list[bool] | None:
        """The slots the backward running now reached through views of fast weights so far
        (a backward on fast weights crosses many gathers before their start, and inner
        backwards that never reach it note theirs under their own task)."""
        known = self._task_reach
        if known is None or known[0] != torch._C._current_graph_task_id():
            return None
        return known[1]

    def forget_task_reach(self) -> None:
        """Start the record afresh: what :meth:`last_task_reach` reads next is noted by
        backwards that run from now on."""
        self._task_reach = None

    def last_task_reach(self) -> list[bool]:
        """The slots the last backward noted reached, read after it returned (none noted:
        none reached)."""
        known = self._task_reach
        return list(known[1]) if known is not None else [False] * len(self.slots)

    def _take_reached(self) -> list[bool] | None:
        mask, self._pending_reach = self._pending_reach, None
        return mask

    def gradient_added(self, mask: list[bool] | None) -> None:
        """A gradient of the slots ``mask`` marks is about to go into ``shard.grad``
        (reduced here, or added by the meta engine): a fresh gradient starts the record."""
        self.reached = mask if self.shard.grad is None else _union(self.reached, mask)
        self.cleared.clear()

    # ----- gradients ------------------------------------------------------------------
    def reduce(self, grad: torch.Tensor, owned: bool = False) -> torch.Tensor | None:
        """Backward of the unshard: this rank's shard of the mean gradient over ranks.
        ``owned``: of an owned copy, which neither counts as a graph on the buffer nor
        frees it."""
        accumulating = self.acc_node is not None and will_accumulate(self.acc_node)
        if not accumulating and not shard_grads_allowed():
            refuse_shard_grad()
        reach = self._take_reached()
        if not owned:
            # at 0 already: a graph kept by retain_graph=True, backpropagated again
            self._live = max(self._live - 1, 0)
        scale = self.scale()
        if torch.is_grad_enabled():
            # create_graph: differentiable collectives. The parameters stay gathered: the
            # recorded backward graph reads them again in a double backward.
            g = grad.to(self.reduce_dtype) * scale
            out = functional.reduce_scatter(g, "sum", group=self.group)
            if self.replicate_group is not SELF:
                out = functional.all_reduce(out, "sum", group=self.replicate_group)
            if accumulating:
                self.gradient_added(reach)
            return out.to(self.shard.device, self.shard.dtype)
        # autograd hands us a fresh buffer (the split's concatenated gradient): the collective
        # may overwrite it; anything else (a view, an expanded zero) is copied first.
        g = grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype)
        if not g.is_contiguous() or g._is_view():
            g = g.contiguous().clone()
        if not owned:
            self.maybe_free()  # this graph no longer needs the parameters
        if self._on_reduce is not None:
            self._on_reduce()
        if self._stash is not None:
            g += self._stash
            reach, self._stash, self._stash_reach = _union(reach, self._stash_reach), None, None
        if not self._sync_grads:
            self._stash = g  # no_sync: accumulate unsharded, reduce with the next synced pass
            self._stash_reach = reach
            return None
        # The mean's 1/N is applied to the shard after the reduction (N times fewer elements);
        # only a rank whose batch weight differs from 1/N rescales its full gradient first.
        factor = scale * self.total
        if factor != 1.0:
            g.mul_(factor)
        # a world of one reduces in place: the fresh buffer is the shard's gradient already
        alone = self.total == 1 and g.numel() == self.shard_size
        out = g if alone else g.new_empty(self.shard_size)
        handle = ops.reduce_scatter(out, g, "sum", group=self.group, async_op=True,
                                    input_is_scratch=True)
        if accumulating:
            # finished by the next one or at the end
            self.coordinator.defer(self, out, handle, reach)
            return None
        self.finish(out, handle)
        return self._mean(out).to(self.shard.device, self.shard.dtype)

    def _mean(self, summed: torch.Tensor) -> torch.Tensor:
        """``summed / total`` in place; nothing at a total of one (x * 1.0 is x)."""
        return summed if self.total == 1 else summed.mul_(1.0 / self.total)

    def finish(self, out: torch.Tensor, handle: Handle) -> None:
        """Complete a reduce-scatter (and the sum across replicas, for hsdp)."""
        handle.wait()
        if self.replicate_group is not SELF:
            ops.all_reduce(out, "sum", group=self.replicate_group)

    def accumulate(self, reduced: torch.Tensor, reach: list[bool] | None) -> None:
        """Add a reduced (summed, not yet averaged) shard gradient into ``shard.grad``;
        ``reach``: the slots it has a gradient for."""
        self.gradient_added(reach)
        # Non-blocking only towards the device: a device-to-host copy (cpu_offload) must be
        # complete before the CPU arithmetic below reads it, and nothing orders the two.
        value = reduced.to(self.shard.device, self.shard.dtype,
                           non_blocking=self.shard.device.type != "cpu")
        if self.shard.grad is None:
            self.shard.grad = self._mean(value)
        else:
            self.shard.grad.add_(value, alpha=1.0 / self.total)


def split_views(full: torch.Tensor, flat: FlatParam) -> list[torch.Tensor]:
    """Parameter-shaped views of a full buffer (plain views: no record of reach)."""
    pieces = full.split([*(s.numel for s in flat.slots), flat.padded - flat.numel])
    return [piece.view(s.shape) for piece, s in zip(pieces, flat.slots, strict=False)]


def _union(a: list[bool] | None, b: list[bool] | None) -> list[bool] | None:
    if a is None or b is None:
        return b if a is None else a
    return [x or y for x, y in zip(a, b, strict=True)]


class _Views(torch.autograd.Function):
    """The split of a full buffer into parameter views (what ``split`` does), whose backward
    also tells the flat which views a gradient reached: autograd hands it None for the
    others, where one process leaves ``grad=None``."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, flat: FlatParam) -> tuple[torch.Tensor, ...]:
        ctx.flat = flat
        ctx.set_materialize_grads(False)
        return tuple(split_views(full, flat))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None]:
        flat: FlatParam = ctx.flat
        flat.note_reached([g is not None for g in grads])
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None, None
        parts = [g.reshape(-1) if g is not None else like.new_zeros(s.numel)
                 for g, s in zip(grads, flat.slots, strict=True)]
        if flat.padded > flat.numel:
            parts.append(like.new_zeros(flat.padded - flat.numel))
        return torch.cat(parts), None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, flat: FlatParam) -> torch.Tensor:
        ctx.flat = flat
        return flat.full.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return ctx.flat.reduce(grad), None


class _UnshardOwned(torch.autograd.Function):
    """Like :class:`_Unshard`, for a gathered copy the graph owns. It saves no tensors, so
    every graph built on one copy may run through it."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, flat: FlatParam) -> torch.Tensor:
        ctx.flat = flat
        return flat._gather_copy()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return ctx.flat.reduce(grad, owned=True), None
