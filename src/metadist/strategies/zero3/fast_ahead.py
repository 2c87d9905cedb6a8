"""zero3/hsdp fast weights: gathers started ahead of their use (FSDP2's prefetch, on pieces).

A forward on fast weights gathers each unit as its members run, and a backward gathers a
saved weight again when it reads it (strategies/zero3/shard_gather.py). Waiting on each gather
where it is needed leaves the compute idle for every exchange: at a small batch the sharded
meta-step measured about twice the gathered path's time, nearly all of it in the gathers.
So the gather most likely needed next is started while the current unit computes:

* **Forward.** When a unit opens, the unit that followed it in the model's last forward on
  fast weights is gathered ahead (its order is the model's, :attr:`Schedule.fast_order`).
* **The turn to backward.** The unit whose weights a forward saved last stays gathered
  (:class:`LastUnit`): the backward that follows reads its saved weights first. That is the
  last unit to run, or a root unit whose head runs after every block (a language model's).
* **Backward.** When a saved view is gathered again, the saved weights of the unit next to it
  in the order its forward saved them (shard_gather.SavedOrder) are gathered ahead, in the
  direction the backward is going: a plain backward reads a forward's units last to first,
  the backward of a recorded backward (second order) first to last. :class:`BackwardAhead`
  follows which way the reads went.
  A unit whose forward saved several views (a transformer block's layers) is gathered once
  for them: its buffer is held until the backward reads another unit.

The guesses are the same on every rank: they depend only on the order units run and saved
views are read, which the program fixes, never on timing. A gather started ahead that is not
used (the guess was wrong, or the unit's source changed in place since) is waited and
dropped, so the collectives stay in step on every rank and the value used is always a gather
of the current source. At most one is in flight for the forward and one for the backward,
one forward's last unit is kept, and one unit is held for its several saved views: each
costs at most one unit's buffer.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from metadist.comm import ops
from metadist.comm.handle import Handle
from metadist.strategies.tensors.shard_piece import plain
from metadist.strategies.zero3.gather_buffers import BUFFERS

if TYPE_CHECKING:
    from metadist.strategies.zero3.flat import FlatParam


@dataclass
class Counts:
    """Gathers of fast weights by how they were made: started ahead, of those the ones
    used, made where they were needed, and reads that needed none. (Tests and benchmarks
    read :data:`COUNTS`.)"""

    started: int = 0
    used: int = 0
    at_use: int = 0
    kept: int = 0  # reads served by the buffer the read before gathered: no gather at all

    def count(self, ahead: bool = False, used: bool = False, kept: bool = False) -> None:
        with _lock:
            if kept:
                self.kept += 1
            elif used:
                self.used += 1
            elif ahead:
                self.started += 1
            else:
                self.at_use += 1

    def snapshot(self) -> Counts:
        with _lock:
            return Counts(self.started, self.used, self.at_use, self.kept)


_lock = threading.Lock()
COUNTS = Counts()


class Ahead:
    """An all-gather of a piece in flight: the whole buffer once waited. Every one is waited
    (taken or dropped) before it is let go: on gloo a receive dropped unwaited is cancelled,
    and its peer's send, which waits for it, holds up every later send to that peer."""

    __slots__ = ("__weakref__", "buffer", "handle", "kept", "kept_version", "source",
                 "version")

    def __init__(self, source: Tensor, flat: FlatParam | None, ahead: bool = True,
                 kept: Tensor | None = None) -> None:
        self.source, self.version, self.kept = source, source._version, kept is not None
        # a kept buffer was handed to a backward node already: used again only unchanged
        self.kept_version = -1 if kept is None else kept._version
        self.buffer: Tensor | None = kept
        self.handle: Handle | None = None  # it holds the buffer too: let go once waited
        if kept is not None:  # a gather made already, kept for one more read
            return
        assert flat is not None
        COUNTS.count(ahead=ahead)
        out = self.buffer = BUFFERS.take(flat.padded, flat.compute_dtype, flat.device)
        mine = out.narrow(0, flat.rank * flat.shard_size, flat.shard_size)  # written in
        n = source.numel()                                                 # place: no copy
        with torch.no_grad():                                              # to send
            mine[:n].copy_(plain(source.detach()))
            mine[n:].zero_()  # the padding
        self.handle = ops.all_gather(out, mine, group=flat.group, async_op=True)

    def take(self, source: Tensor) -> Tensor | None:
        """The gathered buffer if it is a gather of ``source`` as it is now; else None (it
        is dropped, and the caller gathers afresh)."""
        buffer = self.drop()
        if buffer is None or source is not self.source or source._version != self.version \
                or (self.kept and buffer._version != self.kept_version):
            return None
        COUNTS.count(used=not self.kept, kept=self.kept)
        return buffer

    def drop(self) -> Tensor | None:
        """Finish the exchange (every rank started it) and let the buffer go."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        buffer, self.buffer = self.buffer, None
        return buffer


def gather_now(source: Tensor, flat: FlatParam) -> Tensor:
    """``source`` (this rank's slice of ``flat``, padding or not) gathered whole, outside
    autograd."""
    out = Ahead(source, flat, ahead=False).drop()
    assert out is not None
    return out


class Neighbours(Protocol):
    """What :class:`BackwardAhead` reads of a gather (shard_gather.Gathered)."""

    ahead: Ahead | None
    prefetch: bool
    saved_views: int

    def neighbour(self, step: int) -> Neighbours | None: ...

    def start_ahead(self) -> Ahead | None: ...

    def keep(self, buffer: Tensor) -> Ahead: ...


class BackwardAhead(threading.local):
    """The backward's guess of the next saved weight it reads (one per thread: each thread
    runs its own backwards)."""

    def __init__(self) -> None:
        self.last: weakref.ref[Neighbours] | None = None
        self.step = -1  # -1: towards a forward's first unit (a plain backward)
        self.pending: Ahead | None = None
        # the unit whose several saved views are being read, and its buffer kept for them
        self.held: tuple[weakref.ref[Neighbours], Ahead] | None = None
        self.task = -1  # the graph task whose end drops what is pending and held
        self.by_forward = True  # the last read was of a view its forward saved

    def read(self, gathered: Neighbours, full: Tensor, by_forward: bool = True) -> None:
        """``gathered``'s saved view is being gathered again (into ``full``), inside a
        backward: start the gather of its neighbour in the direction the reads go.
        ``by_forward``: the view was saved by the forward that gathered it, not by a
        backward recorded on that forward."""
        task = torch._C._current_graph_task_id()
        if task == -1 or not gathered.prefetch:  # outside a backward (a saved tensor looked
            return                                # at), or the model's prefetch is off
        last = None if self.last is None else self.last()
        turned = last is gathered and by_forward != self.by_forward  # see below
        self.by_forward = by_forward
        if gathered.saved_views > 1:  # its other saved views are read next: one gather
            self._hold(task, gathered, full)
            if last is gathered and not turned:  # still within the unit: not moved
                return
        elif self.held is not None:
            self._let_go_held()
        walked = False  # the read before was this one's neighbour: the reads walk a forward
        for step in (-1, 1):
            if last is not None and gathered.neighbour(-step) is last:
                self.step, walked = step, True
        self.last = weakref.ref(gathered)
        nxt = gathered.neighbour(self.step)
        if nxt is None and walked:
            # The walk reached a forward's end. A second-order backward reads a forward's
            # saved weights twice in a row: first to last through the backward recorded on
            # it, then back through the forward itself, starting with this one again: a
            # read of a view its forward saved after reads of views the recorded backward
            # saved (``turned``), which starts the gather of the next unit on the way back.
            self._start(task, gathered.keep(full))
            return
        if nxt is None:  # one read at an end, coming from elsewhere: the walk starts here
            self.step = -self.step
            nxt = gathered.neighbour(self.step)
        if nxt is not None and (nxt.ahead is None or nxt.ahead.buffer is None):
            self._start(task, nxt.start_ahead())

    def _start(self, task: int, ahead: Ahead | None) -> None:
        self._drop()
        self.pending = ahead
        if self.pending is not None:
            self._end_with(task)

    def _hold(self, task: int, gathered: Neighbours, full: Tensor) -> None:
        """Serve the next reads of ``gathered`` from ``full`` until a read of another unit
        (one unit's buffer at a time, as FSDP2 keeps a unit gathered for its backward)."""
        if self.held is not None and self.held[0]() is not gathered:
            self._let_go_held()
        ahead = gathered.ahead
        if ahead is None or ahead.buffer is None:
            ahead = gathered.keep(full)
        self.held = (weakref.ref(gathered), ahead)
        self._end_with(task)

    def _let_go_held(self) -> None:
        assert self.held is not None
        gathered, ahead = self.held[0](), self.held[1]
        self.held = None
        if gathered is not None and gathered.ahead is ahead:
            gathered.ahead = None
        ahead.drop()

    def _end_with(self, task: int) -> None:
        if task != self.task:
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self.task = -1
        self.last, self.by_forward = None, True
        self._drop()
        if self.held is not None:
            self._let_go_held()

    def _drop(self) -> None:
        if self.pending is not None:
            self.pending.drop()
            self.pending = None


BACKWARD = BackwardAhead()


class LastUnit(threading.local):
    """The last unit of the latest forward on fast weights, kept whole for the backward
    that usually follows at once and reads that unit's saved weights first (FSDP2 keeps its
    root unit for the same read). One at a time per thread: forwards that run before any
    backward keep at most one unit alive between them. Held weakly: only the gather's record
    holds the buffer, so a kept buffer no read takes goes with its graph, or with the next
    forward's keep."""

    def __init__(self) -> None:
        self.kept: tuple[weakref.ref[Neighbours], weakref.ref[Ahead]] | None = None

    def keep(self, gathered: Neighbours, buffer: Tensor) -> None:
        self.drop()
        if gathered.ahead is None:
            self.kept = (weakref.ref(gathered), weakref.ref(gathered.keep(buffer)))

    def drop(self) -> None:
        if self.kept is None:
            return
        gathered, ahead = self.kept[0](), self.kept[1]()
        self.kept = None
        if gathered is not None and ahead is not None and gathered.ahead is ahead:
            gathered.ahead = None  # no read took it yet
            ahead.drop()


LAST_UNIT = LastUnit()
