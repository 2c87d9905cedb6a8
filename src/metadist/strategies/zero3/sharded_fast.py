"""zero3/hsdp: fast weights that stay shards (strategies/fast_weights.py has the API).

A cooperative inner loop's memory stays at O(K P / N) for K inner steps because:

* **Pieces are shards.** A rank's fast weights are its slice of every trainable flat buffer
  (the flats' own shards to start with), and the update arithmetic runs on them.
* **One unit at a time.** Inside ``functional_forward(fast, ...)`` each unit is gathered
  (:class:`_FastGather`: all-gather forward, reduce-scatter backward, itself differentiable)
  just before its first member runs and let go after its last, as the strategy's own forward
  does; frozen parameters are gathered without a graph.
* **What autograd saves stays shards**, and second-order gradients do not wait whole
  (strategies/zero3/shard_gather.py).

Weights: a gather is the identity on the group's whole tensor, so its backward is a plain
sum of every rank's gradient. ``fast.grad`` weights each rank's inner loss in the group's
mean once, at the loss (not at every gather: a full-size product per backward). The
strategy's weight of each rank's outer loss (the mean over
ranks), hsdp's sum across replica groups and the record of what a gradient reached are
applied once, where the gradient enters the model's shard (:class:`_Start`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from metadist.comm import functional, ops
from metadist.runtime.world import SELF
from metadist.strategies.bind import Saved, place_of, restore, write
from metadist.strategies.buckets import will_accumulate
from metadist.strategies.cooperative import cooperating
from metadist.strategies.fast_weights import check_even_weights, require_all
from metadist.strategies.tensors.shard_piece import plain
from metadist.strategies.zero3.fast_ahead import LAST_UNIT, Ahead, gather_now
from metadist.strategies.zero3.flat import FlatParam, split_views
from metadist.strategies.zero3.gather_buffers import zeros
from metadist.strategies.zero3.shard_gather import (
    Gathered,
    SavedOrder,
    real_size,
    register,
    saved_as_shards,
    scatter_parts,
    sum_over,
)
from metadist.strategies.zero3.shard_grads import refuse_shard_grad, shard_grads_allowed
from metadist.strategies.zero3.sharded_param import RESOLVERS
from metadist.strategies.zero3.units import Unit, in_backward

_T = TypeVar("_T")


# ----- gathering a piece ---------------------------------------------------------------------
class _FastGather(torch.autograd.Function):
    """A piece of fast weights gathered whole, as its parameters' views. Backward: the
    reduce-scatter of every rank's gradient, a plain sum (the gather is the identity on the
    group's whole tensor; inside ``fast.grad`` each rank's inner loss already carries its
    weight in the group's mean), read from the parameters' gradients where they lie (no
    whole-size concatenation first). It notes which parameters each backward reached, and
    adds the second-order gradients diverted to this gather (strategies/zero3/shard_gather.py)."""

    @staticmethod
    def forward(ctx: Any, piece: Tensor, flat: FlatParam, gathered: list[Gathered],
                ready: Tensor | None) -> tuple[Tensor, ...]:
        ctx.flat, ctx.gathered, ctx.length = flat, gathered, piece.numel()
        ctx.set_materialize_grads(False)
        return tuple(split_views(gather_now(piece, flat) if ready is None else ready, flat))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, None, None, None]:
        flat: FlatParam = ctx.flat
        flat.note_reached([g is not None for g in grads], fast=True)
        out = ctx.gathered[0].take_aside()  # only plain backwards divert
        like = next((g for g in grads if g is not None), None)
        if like is not None:
            dtype = flat.reduce_dtype
            parts = [g.reshape(-1).to(dtype) if g is not None else
                     zeros(s.numel, dtype, like.device)
                     for g, s in zip(grads, flat.slots, strict=True)]
            if flat.padded > flat.numel:
                parts.append(zeros(flat.padded - flat.numel, dtype, like.device))
            summed = scatter_parts(parts, flat)
            out = summed if out is None else (
                summed + out if torch.is_grad_enabled() else summed.add_(out))
        if out is None:  # every gradient was diverted, and none is waiting
            return None, None, None, None
        if ctx.length < out.numel():  # the padding's gradient goes nowhere
            out = out[:ctx.length]
        return out.to(flat.shard.device, flat.shard.dtype), None, None, None


class _Start(torch.autograd.Function):
    """The model's shard as the first fast weights. Every path from a loss to the shard
    crosses this node once, and the gradient arriving here is the sum over the shard group
    of every rank's loss's gradient: the strategy's weight (the mean over ranks), the sum
    across replica groups (hsdp) and the record of what was reached happen here, once."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, flat: FlatParam) -> Tensor:
        ctx.flat = flat
        return shard[:real_size(flat)]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        flat: FlatParam = ctx.flat
        accumulating = flat.acc_node is not None and will_accumulate(flat.acc_node)
        if not accumulating and not shard_grads_allowed():
            refuse_shard_grad()
        _check_weights_once(flat)
        g = grad * flat.scale()
        if g.numel() < flat.shard_size:  # the padding: no gradient
            g = torch.cat([g, g.new_zeros(flat.shard_size - g.numel())])
        g = _sum_replicas(g, flat)
        if accumulating:
            # the parameters this backward reached: through the gathers' views (each notes
            # its own) or a sum over every piece (fast.dot, fast.norm); an element-wise path
            # (fast - lr * g) carries what reached later fast weights
            flat.gradient_added(flat.task_reached() or [True] * len(flat.slots))
        return g, None


_checked_in_backward = [False]


def _check_weights_once(flat: FlatParam) -> None:
    """The strategy's weight is right only if it is every rank's (check_even_weights): one
    collective per backward, at its first :class:`_Start` (the same on every rank)."""
    if _checked_in_backward[0]:
        return
    check_even_weights(flat.scale())
    _checked_in_backward[0] = True
    torch.autograd.Variable._execution_engine.queue_callback(
        lambda: _checked_in_backward.__setitem__(0, False))


def _sum_replicas(g: Tensor, flat: FlatParam) -> Tensor:
    """``g`` summed across hsdp's replica groups (differentiably where a graph is being
    recorded); itself elsewhere."""
    if flat.replicate_group is SELF:
        return g
    if torch.is_grad_enabled():
        return functional.all_reduce(g, "sum", group=flat.replicate_group)
    out = g.clone()
    ops.all_reduce(out, "sum", group=flat.replicate_group)
    return out


def gather(piece: Tensor, flat: FlatParam, ready: Tensor | None = None,
           order: SavedOrder | None = None) -> tuple[list[Tensor], Gathered]:
    """``piece`` whole, as its parameters' views: through :class:`_FastGather` where
    gradients flow, else plain; kept as shards when autograd saves them. ``ready``: the
    piece already gathered (a gather started ahead); ``order``: its forward's gathers in the
    order their views are saved."""
    if torch.is_grad_enabled() and piece.requires_grad:
        holder: list[Gathered] = []
        views = list(_FastGather.apply(plain(piece), flat, holder, ready))
        holder.append(Gathered(piece, flat, views, order))
    else:
        views = split_views(gather_now(piece, flat) if ready is None else ready, flat)
        holder = [Gathered(piece, flat, views, order)]
    register(views[0], holder[0])
    return views, holder[0]


# ----- the forward ---------------------------------------------------------------------------
class FastForward:
    """One ``functional_forward`` on fast weights: units gathered from the pieces as their
    members run (the model's unit hooks route here), let go after them."""

    def __init__(self, pieces: Mapping[FlatParam, Tensor], root_unit: Unit,
                 flats: Sequence[FlatParam]) -> None:
        self.pieces, self.root_unit, self.flats = pieces, root_unit, frozenset(flats)
        self._open: dict[Unit, tuple[int, list[Saved], list[tuple[Gathered, Tensor]]]] = {}
        # read outside the units' forwards: the views, and their gather's record (the
        # saved-tensors hook finds it only while someone holds it)
        self._whole: dict[FlatParam, tuple[list[Tensor], Gathered]] = {}
        self._sources: dict[FlatParam, Tensor] = {}
        self._seen: list[Unit] = []  # the units in the order they opened
        self._ahead: dict[FlatParam, Ahead] = {}  # the next unit's gathers, started ahead
        self._saved = SavedOrder()  # its gathers in the order their views are saved

    def whole(self, flat: FlatParam, index: int) -> Tensor:
        """Parameter ``index`` of ``flat`` on these fast weights, gathered (differentiably)
        for a read outside its unit's forward, e.g. a loss computed through a module's
        method; kept for the rest of this computation."""
        known = self._whole.get(flat)
        if known is None:
            known = self._whole[flat] = gather(self._source(flat), flat)
        return known[0][index]

    def enter(self, unit: Unit) -> None:
        running, saved, made = self._open.get(unit, (0, [], []))
        if not running:
            saved, made = self._bind(unit)
            self._gather_next(unit)
        self._open[unit] = (running + 1, saved, made)

    def leave(self, unit: Unit) -> None:
        running, saved, made = self._open[unit]
        if running > 1:
            self._open[unit] = (running - 1, saved, made)
            return
        del self._open[unit]
        self._let_go(saved, made)
        self._keep_if_last(unit, made)
        if not self._open:  # a recomputation (Resumed) ended: no gather may stay in flight
            self._drop_ahead()

    def close(self) -> None:
        for unit in list(self._open):
            saved, made = self._open.pop(unit)[1:]
            self._let_go(saved, made)
            self._keep_if_last(unit, made, ending=True)
        self._drop_ahead()
        if self._seen:  # the next forward on fast weights likely runs the same order
            self.root_unit.schedule.fast_order = self._seen

    @staticmethod
    def _let_go(saved: list[Saved], made: list[tuple[Gathered, Tensor]]) -> None:
        restore(saved)  # the placeholders back; the buffers live on only in the graph
        for gathered, _ in made:
            gathered.unit_left()

    def _keep_if_last(self, unit: Unit, made: list[tuple[Gathered, Tensor]],
                      ending: bool = False) -> None:
        """The gather whose views this forward saved last stays whole for the backward that
        usually follows at once and reads them first (strategies/zero3/fast_ahead.py,
        :class:`LastUnit`): kept as its unit leaves if that unit opened last in the model's
        last forward on fast weights, or as the forward ends (a root unit's head)."""
        order = self.root_unit.schedule.fast_order
        if not made or in_backward() or not self.root_unit.schedule.prefetch \
                or not (ending or (order and order[-1] is unit)):
            return
        for gathered, buffer in made:
            if self._saved.is_last(gathered):
                LAST_UNIT.keep(gathered, buffer)

    def _source(self, flat: FlatParam) -> Tensor:
        """What ``flat`` is gathered from: its piece, or its shard without a graph (frozen
        or not given)."""
        out = self._sources.get(flat)
        if out is None:
            piece = self.pieces.get(flat, flat.shard)
            out = self._sources[flat] = piece if flat.shard.requires_grad else \
                flat.shard.detach()
        return out

    def _bind(self, unit: Unit) -> tuple[list[Saved], list[tuple[Gathered, Tensor]]]:
        placed: list[tuple[tuple[dict[str, Any], str], Tensor]] = []
        made = []
        for flat in unit.flats:
            source, ahead = self._source(flat), self._ahead.pop(flat, None)
            views, gathered = gather(source, flat, None if ahead is None else ahead.take(source),
                                     self._saved)
            gathered.prefetch = self.root_unit.schedule.prefetch
            made.append((gathered, views[0].detach()))  # the buffer, for _keep_if_last
            for slot, view in zip(flat.slots, views, strict=True):
                placed += [(place_of(module, attr), view) for module, attr in slot.uses]
        return write(placed), made

    def _gather_next(self, unit: Unit) -> None:
        """``unit`` opened: start gathering the unit that followed it in the model's last
        forward on fast weights (strategies/zero3/fast_ahead.py), after dropping a guess that
        did not come."""
        self._drop_ahead()
        if in_backward():  # a recomputation runs some units, not the forward's order
            return
        if unit not in self._seen:
            self._seen.append(unit)
        schedule = self.root_unit.schedule
        order = schedule.fast_order
        if not schedule.prefetch or unit not in order:
            return
        i = order.index(unit) + 1
        if i < len(order) and order[i] not in self._open:
            self._ahead = {flat: Ahead(self._source(flat), flat) for flat in order[i].flats}

    def _drop_ahead(self) -> None:
        for ahead in self._ahead.values():
            ahead.drop()
        self._ahead = {}


#: the fast forwards running now, by the id of their model's user module
_ACTIVE: ContextVar[Mapping[int, FastForward]] = ContextVar(
    "metadist_fast_forward", default=MappingProxyType({}))


def active_for(root: nn.Module) -> FastForward | None:
    """The fast forward running on ``root`` (a zero3 model's user module), if any."""
    return _ACTIVE.get().get(id(root))


class Resumed:
    """Makes the fast forwards that were running when this was made run again while
    entered (re-enterable): activation checkpointing's recomputation in backward runs the
    blocks on the same fast weights, not on the model's shards."""

    def __init__(self) -> None:
        self._running = _ACTIVE.get()
        self._tokens: list[Any] = []

    def __enter__(self) -> None:
        self._tokens.append(_ACTIVE.set(self._running))
        for forward in self._running.values():  # each root unit was gathered throughout
            forward.enter(forward.root_unit)

    def __exit__(self, *exc: object) -> None:
        for forward in self._running.values():
            forward.leave(forward.root_unit)
        _ACTIVE.reset(self._tokens.pop())


@contextmanager
def fast_forward(root: nn.Module, pieces: Mapping[FlatParam, Tensor],
                 root_unit: Unit, flats: Sequence[FlatParam]) -> Iterator[FastForward]:
    """Run ``root``'s forwards on fast ``pieces`` within (the root unit gathered
    throughout): one ``functional_forward``, or a problem's whole computation. ``flats``:
    every flat of the model (a read of one of its parameters outside the units' forwards
    is served from the fast weights too)."""
    forward = FastForward(pieces, root_unit, flats)
    first = next(iter(pieces))  # every flat has the same shard and replica groups
    token = _ACTIVE.set(MappingProxyType({**_ACTIVE.get(), id(root): forward}))
    try:
        with cooperating(first.group, ops.group_info(first.group)[1],
                         ops.group_info(first.replicate_group)[1]), saved_as_shards():
            forward.enter(forward.root_unit)
            try:
                yield forward
            finally:
                forward.close()
    finally:
        _ACTIVE.reset(token)


def _resolve(source: tuple[FlatParam, int]) -> Tensor | None:
    """A zero3 parameter read between forwards, inside a computation on fast weights."""
    flat, index = source
    for forward in _ACTIVE.get().values():
        if flat in forward.flats:
            return forward.whole(flat, index)
    return None


RESOLVERS.append(_resolve)


# ----- the layout ----------------------------------------------------------------------------
class _GroupSum(torch.autograd.Function):
    """A sum over the shard group of a value summed over every piece. Backward: the sum of
    every rank's gradient, which reaches every parameter of ``flats``."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, flats: tuple[FlatParam, ...]) -> Tensor:
        ctx.flats = flats
        return sum_over(value.detach(), flats[0], scatter=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        flats: tuple[FlatParam, ...] = ctx.flats
        for flat in flats:
            flat.note_reached([True] * len(flat.slots), fast=True)
        g = sum_over(grad.to(flats[0].reduce_dtype), flats[0], scatter=False)
        return g.to(grad.dtype), None


class ShardedLayout:
    """Fast weights as one shard per trainable flat (zero3/hsdp)."""

    sharded = True

    def __init__(self, flats: Sequence[FlatParam]) -> None:
        self.flats = [flat for flat in flats if flat.shard.requires_grad]
        if not self.flats:
            raise ValueError("fast_weights(): the model has no trainable parameters")
        self.names = tuple(slot.fqn for flat in self.flats for slot in flat.slots)

    def group_size(self) -> int:
        return ops.group_info(self.flats[0].group)[1]

    def group_rank(self) -> int:
        return ops.group_info(self.flats[0].group)[2]

    def replicas(self) -> tuple[int, int]:
        _, count, index = ops.group_info(self.flats[0].replicate_group)
        return count, index

    def group(self) -> Any:
        return self.flats[0].group

    def initial(self) -> tuple[Tensor, ...]:
        return tuple(_Start.apply(flat.shard, flat) for flat in self.flats)

    def by_flat(self, pieces: Sequence[Tensor]) -> dict[FlatParam, Tensor]:
        if len(pieces) != len(self.flats):
            raise ValueError(f"fast weights of {len(pieces)} pieces for a model of "
                             f"{len(self.flats)} flat shards")
        return dict(zip(self.flats, pieces, strict=True))

    def shards_of(self, pieces: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """(a flat's shard, ``pieces``' piece of it as a detached tensor of the shard's
        size, zeros in its padding), per trainable flat this rank holds elements of: where a
        gradient with respect to the pieces lands (a shard of padding alone gets none, as
        from a backward)."""
        out: list[tuple[Tensor, Tensor]] = []
        for flat, piece in self.by_flat(pieces).items():
            if real_size(flat) == 0:
                continue
            g = plain(piece).detach().reshape(-1)
            pad = flat.shard.numel() - g.numel()
            out.append((flat.shard, (torch.cat([g, g.new_zeros(pad)]) if pad else g)
                        .view_as(flat.shard)))
        return out

    def reduce_sum(self, value: Tensor) -> Tensor:
        out: Tensor = _GroupSum.apply(plain(value), tuple(self.flats))
        return out

    def grads(self, loss: Tensor, pieces: Sequence[Tensor], create_graph: bool,
              share: float | None) -> tuple[Tensor, ...]:
        check_even_weights(self.flats[0].scale())
        weight = 1.0 / self.group_size()  # uneven slices: weighted by their forwards
        # the rank's weight in the group's mean, at the loss: every backward below it
        # (gathers, group sums) is then a plain sum over the group
        with saved_as_shards():
            out = torch.autograd.grad(loss * weight, list(pieces), create_graph=create_graph,
                                      allow_unused=True, materialize_grads=True)
        return tuple(out)

    def unreached(self, take: Callable[[], _T]) -> tuple[_T, list[str]]:
        """``take()``, one backward with respect to the pieces, and the names of the
        parameters it did not reach: a piece's gradient is a tensor for every parameter of
        a unit that ran, so what a gradient of whole parameters says by ``None`` is read
        from the record the gathers keep of what each backward reached."""
        for flat in self.flats:
            flat.forget_task_reach()
        out = take()
        return out, [slot.fqn for flat in self.flats
                     for slot, hit in zip(flat.slots, flat.last_task_reach(), strict=True)
                     if not hit]

    def recording(self) -> AbstractContextManager[Any]:
        return saved_as_shards()

    def mean_of_local(self, grads: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """What the mean over ranks of every rank's own gradient is, in pieces, given
        gradients taken with respect to the pieces (a gather's backward has summed the
        shard group's already): the sum across replica groups (hsdp), over the world's size.
        The hypergradient functions' ``grad_sync`` convention (metadist.meta.hypergrad)."""
        flat = self.flats[0]
        size = self.group_size() * ops.group_info(flat.replicate_group)[1]
        return tuple(_sum_replicas(plain(g), flat) / size for g in grads)

    def like(self, values: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        require_all(self.names, values)
        out = []
        for flat in self.flats:
            parts = [values[s.fqn].reshape(-1).to(flat.shard.dtype) for s in flat.slots]
            lo = flat.rank * flat.shard_size
            out.append(torch.cat(parts)[lo:lo + real_size(flat)])
        return tuple(out)

    def full(self, pieces: Sequence[Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for flat, piece in zip(self.flats, pieces, strict=True):
            views = gather(piece, flat)[0]  # differentiable
            out.update((s.fqn, v) for s, v in zip(flat.slots, views, strict=True))
        return out
