"""zero3/hsdp fast weights: gathering a shard piece, and what autograd saves from it.

A forward on fast weights gathers each unit's piece into a whole buffer (a :class:`Gathered`)
for as long as the unit's members run. Two things would keep those buffers, or buffers of
their size, alive far longer, and this module prevents both:

* **Saved tensors.** Autograd saves views of a gathered buffer for the backward (a linear
  layer's weight). Inside :func:`saved_as_shards` a saved-tensors hook replaces each by a
  reference to its piece (:class:`_Packed`) and gathers the piece again when a backward
  reads it. Autograd gives the tensor it hands back the saved view's own graph node, so the
  gradient still reaches the piece through the forward's gather.
* **Second-order gradients in waiting.** A backward recorded with ``create_graph=True``
  (``fast.grad``) reads a saved weight, so the graph it records sends a gradient to that
  weight's node in the forward graph. There it would wait, whole, for the forward's own
  gradient of the weight, which the outer backward produces only when it reaches that layer
  again: a whole model's gradient in waiting at once. So the node that produces such a
  contribution gets a hook that scatters it into a shard-sized gradient kept with the
  gather (:meth:`Gathered.divert`) and sends nothing on; the gather's backward adds it to
  its own (strategies/zero3/sharded_fast.py). Only plain backwards divert; a backward that records
  a graph sends the gradient on as usual.
  A unit that saved several views (a block's layers) has them summed whole while the backward
  diverts to them one after the other, and scattered once (:class:`_Summing`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from metadist.comm import functional, ops
from metadist.strategies.zero3.fast_ahead import BACKWARD, Ahead, gather_now
from metadist.strategies.zero3.flat import FlatParam
from metadist.strategies.zero3.gather_buffers import BUFFERS, zeros

_DIVERTED = "metadist_diverted"  # node metadata: the edges whose gradient a hook diverts
_SEARCH_DEPTH = 8  # nodes a backward formula builds between its outputs and a saved input


def scatter_parts(parts: list[Tensor], flat: FlatParam) -> Tensor:
    """The concatenation of ``parts`` (a gradient of the whole buffer, as the parameters'
    gradients and the padding) summed over the shard group, this rank's shard of it, read
    where the parts lie; differentiably where a graph is being recorded."""
    if torch.is_grad_enabled():
        out: Tensor = _ScatterParts.apply(flat, *parts)
        return out
    out = parts[0].new_empty(flat.shard_size)
    ops.reduce_scatter_parts(out, parts, "sum", group=flat.group)
    return out


class _ScatterParts(torch.autograd.Function):
    """:func:`scatter_parts` recorded: a second-order gradient of a gather's backward. Its
    own backward (the outer backward of a meta-step) all-gathers the shard's gradient into
    a reused whole buffer (strategies/zero3/gather_buffers.py) and hands each part its
    slice; recorded further (a third order) through the differentiable all-gather."""

    @staticmethod
    def forward(ctx: Any, flat: FlatParam, *parts: Tensor) -> Tensor:
        ctx.flat, ctx.sizes = flat, [p.numel() for p in parts]
        out = parts[0].new_empty(flat.shard_size)
        ops.reduce_scatter_parts(out, [p.reshape(-1) for p in parts], "sum", group=flat.group)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        flat: FlatParam = ctx.flat
        if torch.is_grad_enabled():
            full = functional.all_gather(g, group=flat.group)
        else:
            full = BUFFERS.take(flat.padded, g.dtype, g.device)
            ops.all_gather(full, g.contiguous(), group=flat.group)
        return (None, *full.split(ctx.sizes))


def sum_over(g: Tensor, flat: FlatParam, scatter: bool, scratch: bool = False) -> Tensor:
    """``g`` summed over the shard group (reduce-scattered if ``scatter``), differentiably
    where a graph is being recorded; ``scratch``: the reduction may overwrite ``g``."""
    if torch.is_grad_enabled():
        if scatter:
            return functional.reduce_scatter(g, "sum", group=flat.group, input_is_scratch=scratch)
        return functional.all_reduce(g, "sum", group=flat.group)
    if not scatter:
        out = g.clone()
        ops.all_reduce(out, "sum", group=flat.group)
        return out
    out = g.new_empty(flat.shard_size)
    ops.reduce_scatter(out, g.contiguous(), "sum", group=flat.group, input_is_scratch=scratch)
    return out


def _dense(t: Tensor) -> bool:
    """``t``'s elements fill a block of its storage once each (a contiguous tensor with its
    dimensions permuted)."""
    expected = 1
    dims = [(n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1]
    for n, st in sorted(dims, key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= n
    return True


def real_size(flat: FlatParam) -> int:
    """Elements of this rank's shard that are parameters, not the flat's padding: the length
    of its fast weights' piece (padding never meets the user's arithmetic, where a
    square root's derivative at its zeros would turn into NaN)."""
    return max(0, min(flat.shard_size, flat.numel - flat.rank * flat.shard_size))


class Gathered:
    """One gather of a piece: what its saved views refer to, and the second-order gradient
    diverted to it (this rank's shard of it) until its backward takes it."""

    __slots__ = ("__weakref__", "ahead", "aside", "flat", "left", "node", "noting", "order",
                 "piece", "prefetch", "saved_views", "sides", "summing", "used")

    def __init__(self, piece: Tensor, flat: FlatParam, views: list[Tensor],
                 order: SavedOrder | None = None) -> None:
        self.piece, self.flat = piece, flat
        # the gathers whose views its forward saved just before and after this one's
        # (weakly: each holds its piece), and a gather of this one started ahead
        # (strategies/zero3/fast_ahead.py)
        self.sides: dict[int, weakref.ref[Gathered]] = {}
        self.order = order
        self.ahead: Ahead | None = None
        # views saved while the unit's members ran: more than one (a block's several layers)
        # and a backward reads them one after the other, each needing the same gather
        self.saved_views, self.left = 0, False
        self.prefetch = False  # a backward reading it may gather its neighbour ahead
        # The gather's backward (None without a graph), weakly: its node holds this through
        # its context, and a node held back by what it holds is a cycle the garbage collector
        # cannot free (each meta-step's pieces and graph stayed alive for good).
        node = views[0].grad_fn
        self.node = None if node is None else weakref.ref(node)
        # its backward notes what each backward reached (FlatParam.task_reached)
        self.noting = views[0].requires_grad
        self.aside: Tensor | None = None
        self.summing: Tensor | None = None  # diverted gradients of several views, whole
        # The sequence numbers of the nodes the forward built while the unit ran: those
        # consume the buffer as the forward does, and their gradient is not diverted (it
        # reaches this gather's backward in its turn, and would only cost a reduce-scatter).
        start = torch._C._autograd._get_sequence_nr()
        self.used = (start, start)

    def neighbour(self, step: int) -> Gathered | None:
        """The gather whose views its forward saved next ``step`` (-1 or 1) ways from this
        one's: the one a backward reads after this one, in one direction or the other."""
        ref = self.sides.get(step)
        return None if ref is None else ref()

    def start_ahead(self) -> Ahead:
        self.ahead = Ahead(self.piece, self.flat)
        return self.ahead

    def keep(self, buffer: Tensor) -> Ahead:
        """Serve the next read from ``buffer``, the gather the read now got."""
        self.ahead = Ahead(self.piece, None, kept=buffer)
        return self.ahead

    def whole(self) -> Tensor:
        """The piece gathered again: the gather started ahead if it is of the piece as it
        is, else now."""
        ahead, self.ahead = self.ahead, None
        full = None if ahead is None else ahead.take(self.piece)
        return gather_now(self.piece, self.flat) if full is None else full

    def unit_left(self) -> None:
        """The unit's members have run: the forward's own consumers are all built."""
        self.used = (self.used[0], torch._C._autograd._get_sequence_nr())
        self.left = True

    def built_by_forward(self, node: Any) -> bool:
        return bool(self.used[0] <= node._sequence_nr() < self.used[1])

    def divert(self, grad: Tensor, view: _Packed) -> None:
        """Scatter the gradient of a saved view of this buffer into this rank's shard. The
        views of a unit that saved several are summed whole while the backward diverts to
        them one after the other, and scattered once (:data:`SUMMING`)."""
        flat = self.flat
        dtype, device = flat.reduce_dtype, flat.device
        lo, hi = view.span()
        if self.noting:  # the gradient reached the view's parameter
            flat.note_reached([s.offset <= lo < s.offset + s.numel for s in flat.slots],
                              fast=True)
        if self.saved_views > 1:
            SUMMING.start(self)
            if self.summing is None:
                self.summing = BUFFERS.take(flat.padded, dtype, device)
                self.summing.zero_()
            self.summing.as_strided(view.size, view.stride, view.offset).add_(grad)
            return
        if hi - lo == grad.numel() and grad.dtype == dtype and grad.device == device \
                and grad.stride() == tuple(view.stride) and _dense(grad):
            # laid out in memory as the view lies in the buffer: read where it lies
            span = grad.as_strided((hi - lo,), (1,), grad.storage_offset())
        else:
            span = BUFFERS.take(hi - lo, dtype, device)
            into = span.as_strided(view.size, view.stride, view.offset - lo)
            if hi - lo == grad.numel():  # the view covers its span
                into.copy_(grad)
            else:
                span.zero_()
                into.add_(grad)
        # the same parts on every rank (the view's span between zeros), whatever the layout
        # of this rank's gradient: a reduce-scatter of parts sends them as they are cut
        parts = [zeros(lo, dtype, device), span, zeros(flat.padded - hi, dtype, device)]
        self._set_aside(scatter_parts([p for p in parts if p.numel()], flat))

    def scatter_summed(self) -> None:
        """Scatter the views' gradients summed so far into this rank's shard."""
        summing, self.summing = self.summing, None
        if summing is not None:
            with torch.no_grad():  # only plain backwards divert (also when it ends)
                self._set_aside(sum_over(summing, self.flat, scatter=True, scratch=True))

    def _set_aside(self, out: Tensor) -> None:
        self.aside = out if self.aside is None else self.aside.add_(out)

    def take_aside(self) -> Tensor | None:
        if self.summing is not None:
            SUMMING.finish()
        aside, self.aside = self.aside, None
        return aside


class SavedOrder:
    """The gathers of one forward, linked in the order its layers last saved a view of each
    (:attr:`Gathered.sides`): a backward reads saved weights in that order reversed, and a
    recorded backward's own backward in that order. The order the units were gathered in
    is not it: a root unit gathered first for its embedding whose head is read first (a
    language model's) would have the backward's guesses walk away from every read."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: weakref.ref[Gathered] | None = None

    def saved(self, gathered: Gathered) -> None:
        """``gathered``'s forward saved a view of it: it moves to the end of the order."""
        last = None if self.last is None else self.last()
        if last is gathered:
            return
        before, after = gathered.neighbour(-1), gathered.neighbour(1)
        for near, step, far in ((before, 1, after), (after, -1, before)):
            if near is not None:
                near.sides.pop(step, None)
                if far is not None:
                    near.sides[step] = weakref.ref(far)
        gathered.sides = {}
        if last is not None:
            gathered.sides[-1], last.sides[1] = weakref.ref(last), weakref.ref(gathered)
        self.last = weakref.ref(gathered)

    def is_last(self, gathered: Gathered) -> bool:
        return self.last is not None and self.last() is gathered


class _Summing(threading.local):
    """The gather whose views' diverted gradients are being summed whole: one at a time per
    thread (a backward diverts to a unit's views one after the other), scattered when a
    backward diverts to another gather, when the gather's own backward takes them, or when
    the backward ends. Where it scatters depends only on the order the backward runs its
    nodes, the same on every rank."""

    def __init__(self) -> None:
        self.gathered: Gathered | None = None
        self.task = -1

    def start(self, gathered: Gathered) -> None:
        if self.gathered is not gathered:
            self.finish()
            self.gathered = gathered
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def finish(self) -> None:
        gathered, self.gathered = self.gathered, None
        if gathered is not None:
            gathered.scatter_summed()

    def _end(self) -> None:
        self.task = -1
        self.finish()


SUMMING = _Summing()


class _Packed:
    """A saved view of a gathered buffer, as the gather it came from and where it lies."""

    __slots__ = ("by_forward", "gathered", "node", "offset", "output_nr", "size", "stride")

    def __init__(self, gathered: Gathered, view: Tensor) -> None:
        self.gathered = gathered
        self.by_forward = not gathered.left  # else saved by a backward recorded on it
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()
        # the view's node in the forward graph: the gradient of the unpacked tensor goes there
        self.node, self.output_nr = view.grad_fn, view.output_nr

    def span(self) -> tuple[int, int]:
        """The first and one past the last element of the buffer the view reaches."""
        last = sum((int(n) - 1) * int(st) for n, st in zip(self.size, self.stride, strict=True))
        return int(self.offset), int(self.offset) + last + 1

    def unpack(self) -> Tensor:
        g = self.gathered
        full = g.whole()
        # the next saved weight's gather overlaps this node's compute
        BACKWARD.read(g, full, self.by_forward)
        _REGISTRY.add(full, g)  # saved again by a recorded backward: packed again
        _DIVERTER.note(self)
        return full.as_strided(self.size, self.stride, self.offset)


class _Registry:
    """Gathered buffers by storage: what the pack hook recognises. It holds neither the
    buffers nor their :class:`Gathered` (each holds its piece, a step's fast weights and,
    through them, the graph that made them): what is alive is kept by its users, the
    gather's node and the packed views, and an entry goes when either of the two goes."""

    def __init__(self) -> None:
        self._by_storage: dict[int, tuple[StorageWeakRef, weakref.ref[Gathered], int]] = {}

    def add(self, full: Tensor, gathered: Gathered) -> None:
        storage = full.untyped_storage()
        # the buffer's version now: a later in-place change makes its saved views unsafe to
        # gather again (a reused buffer's count starts wherever its last use left it)
        self._by_storage[storage._cdata] = (StorageWeakRef(storage), weakref.ref(gathered),
                                            full._version)
        if len(self._by_storage) > 256:  # drop the entries of freed buffers now and then
            self._by_storage = {k: v for k, v in self._by_storage.items()
                                if not v[0].expired() and v[1]() is not None}

    def pack(self, t: Tensor) -> Any:
        # What is not a gathered view is kept as autograd would keep it, but detached: the
        # hook's result must not hold the tensor's grad_fn. A node that saves its own output
        # (tanh, exp, softmax) would otherwise hold itself through it, a cycle through C++
        # that no collection frees, and with it every graph behind it: each meta-step's
        # fast weights and activations, alive for good. (Autograd gives the unpacked tensor
        # its node back.)
        if t.device.type == "meta" or t.is_sparse:
            return t.detach()
        entry = self._by_storage.get(t.untyped_storage()._cdata)
        if entry is None or entry[0].expired() or t._version != entry[2]:
            return t.detach()  # not a gathered view, or changed in place since: as it is
        gathered = entry[1]()
        if gathered is None:
            return t.detach()
        if not gathered.left:  # saved by its own forward, not by a backward reading it
            gathered.saved_views += 1
            if gathered.order is not None:
                gathered.order.saved(gathered)
        return _Packed(gathered, t)

    @staticmethod
    def unpack(obj: Any) -> Tensor:
        return obj.unpack() if isinstance(obj, _Packed) else obj


class _Diverter:
    """Finds the nodes a recorded backward built on unpacked views, and hooks them to divert
    the views' gradients (see the module notes)."""

    def note(self, packed: _Packed) -> None:
        """``packed`` was unpacked by the node running now: if that backward records a
        graph, look at what it built once it returns."""
        node: Any = torch._C._current_autograd_node()
        if node is None or packed.node is None or not torch.is_grad_enabled():
            return
        # A node's hook reaches its node through the metadata dict, never directly: a hook
        # holding its node is a cycle through C++ that the garbage collector cannot see, and
        # it would keep the node, and every graph behind it, alive after the backward.
        metadata = node.metadata
        pending: list[_Packed] | None = metadata.get(_DIVERTED + "_pending")
        if pending is None:
            metadata[_DIVERTED + "_pending"] = [packed]
            node.register_hook(lambda grads, _: self._built(metadata, grads))
        else:
            pending.append(packed)

    def _built(self, metadata: dict[str, Any], grads: tuple[Tensor | None, ...]) -> None:
        packs = metadata.pop(_DIVERTED + "_pending", [])
        targets = {(id(p.node), p.output_nr): p for p in packs}
        seen: set[int] = set()
        frontier = [g.grad_fn for g in grads if g is not None and g.grad_fn is not None]
        ends = {key[0] for key in targets}  # nothing this backward built lies beyond them
        for _ in range(_SEARCH_DEPTH):
            following = []
            for built in frontier:
                if id(built) in seen:
                    continue
                seen.add(id(built))
                edges = {}
                for i, (nxt, nr) in enumerate(built.next_functions):
                    if nxt is None:
                        continue
                    packed = targets.get((id(nxt), nr))
                    if packed is not None and not packed.gathered.built_by_forward(built):
                        edges[i] = packed
                    if id(nxt) not in seen and id(nxt) not in ends:
                        following.append(nxt)
                if edges:
                    self._hook(built, edges)
            frontier = following

    @staticmethod
    def _hook(built: Any, edges: dict[int, _Packed]) -> None:
        known: dict[int, _Packed] | None = built.metadata.get(_DIVERTED)
        if known is not None:
            known.update(edges)
            return
        diverted = built.metadata[_DIVERTED] = dict(edges)  # the hook holds this, not built

        def divert(grads: tuple[Tensor | None, ...], _: Any) -> tuple[Tensor | None, ...] | None:
            if torch.is_grad_enabled():  # a graph is being recorded: send it on
                return None
            out = list(grads)
            for i, packed in diverted.items():
                grad, gathered = out[i], packed.gathered
                node = None if gathered.node is None else gathered.node()
                if grad is None or node is None or not torch._C._will_engine_execute_node(node):
                    continue
                gathered.divert(grad, packed)
                out[i] = None
            return tuple(out)

        built.register_hook(divert)


_REGISTRY = _Registry()
_DIVERTER = _Diverter()


def register(full: Tensor, gathered: Gathered) -> None:
    """Let the pack hook recognise views of ``full``."""
    _REGISTRY.add(full, gathered)


@contextmanager
def saved_as_shards() -> Iterator[None]:
    """Inside: tensors autograd saves that are views of a gathered fast buffer are kept as
    references to their pieces (see the module notes)."""
    with torch.autograd.graph.saved_tensors_hooks(_REGISTRY.pack, _REGISTRY.unpack):
        yield
