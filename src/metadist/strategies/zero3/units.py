"""zero3/hsdp units: the per-unit object the model's hooks route to, and its lifetime.

A :class:`Unit` is a set of modules gathered and freed together; it owns one flat shard per
dtype, optimizer group and ``requires_grad`` (strategies/zero3/flat.py). Its state
(strategies/zero3/unit_state.py: SHARDED, PREFETCHED, FORWARD, GATHERED, BACKWARD) changes only
through its named methods: ``prefetch``/``cancel``, ``pre_forward``/``post_forward``
(``close``), ``pre_backward``/``post_backward``/``reduced``/``end_backward`` (the
end-of-backward callback), ``gather_for_step`` (root), ``after_step``. What the units of
one model share (the last forward's order, which predicts the next forward and, reversed,
the backward; the options; the backward holds) is their :class:`Schedule`.

A *trainable* flat enters autograd through the unshard node, whose backward (the gradient's
reduce-scatter) runs after every node that read its parameters: that is where it is freed.
A *frozen* flat (``requires_grad=False``) has no such node, yet the backward through its
layers reads it (the gradient of a linear layer's input is ``grad_out @ W``), so:

* ``pre_backward`` (on the unit's forward outputs) gathers it whenever a backward goes
  through the unit, and the unit before it is prefetched with it. A unit whose outputs need
  no gradient (frozen layers at the start of a model) gets no backward: freed after its
  forward whatever ``reshard_after_forward`` says;
* each member forward whose inputs require grad passes them through :class:`_PostBackward`,
  an identity whose backward (``post_backward``) runs once the member's input gradients are
  complete (FSDP2's post-backward hook). When those have run for every forward through the
  unit and its trainable flats have reduced, the unit's backward is over and the frozen
  flats are freed: one unit at a time, as for trainable ones;
* a backward with ``create_graph=True`` records nodes that read the weights again in a later
  backward: the frozen flats it reads are *pinned* (strategies/zero3/backward_holds.py) until the
  next plain backward ends (at the latest until the optimizer step). Those of the root unit
  and of ``functional_forward`` graphs, which have no per-unit post-backward, are pinned
  until the backward that reads them ends;
* whatever a plain backward gathered of frozen flats and is still gathered when it ends is
  freed then (a backward that stopped short of a unit's inputs, e.g. ``autograd.grad`` with
  respect to an inner tensor).

A fused unit (several members) is opened by the first member to run and closed when the
members the previous forward ran have all run, in any order (FSDP2's group hooks); a member
skipped this time cannot keep it open: it is also closed when another unit opens while none
of its members runs, or when the model's forward ends. A forward inside a backward is
activation checkpointing's recomputation: it only makes sure the unit is gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from metadist.strategies import agreement
from metadist.strategies.bind import held_at, place_of, write
from metadist.strategies.zero3.backward_holds import BackwardHolds
from metadist.strategies.zero3.flat import FlatParam
from metadist.strategies.zero3.sharded_param import ShardedParam
from metadist.strategies.zero3.unit_state import TRANSITIONS, UnitState, check_transition
from metadist.strategies.zero3.wrap import UnitPlan

_S, _P, _F, _G, _B = (UnitState.SHARDED, UnitState.PREFETCHED, UnitState.FORWARD,
                      UnitState.GATHERED, UnitState.BACKWARD)


def in_backward() -> bool:
    """True inside an autograd backward, where a forward is activation checkpointing's
    recomputation (non-reentrant: it refills saved tensors of the original graph)."""
    return bool(torch._C._current_graph_task_id() != -1)


class Schedule:
    """What the units of one model share: the order the last forward opened them in, the
    options, and the backward holds."""

    def __init__(self, units: list[Unit], *, reshard_after_forward: bool,
                 prefetch: bool) -> None:
        self.units = units
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self._order: list[Unit] = []  # the last forward's unit order: predicts the next one
        self._seen: list[Unit] = []  # this forward's order so far
        # the last forward on fast weights' order (strategies/zero3/sharded_fast.py), kept apart:
        # it may run other units than the model's own forward (a loss through one block)
        self.fast_order: list[Unit] = []
        self._queued = False  # the end-of-backward callback is queued
        #: the unit holding each flat
        self.unit_of = {flat: unit for unit in units for flat in unit.flats}
        self.holds = BackwardHolds(lambda flat: self.unit_of[flat].state is _F)
        for unit in units:
            unit.join(self)

    def next(self, unit: Unit, step: int) -> Unit | None:
        if unit not in self._order:
            return None
        i = self._order.index(unit) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def is_last(self, unit: Unit) -> bool:
        """The last unit of the forward is the first of backward."""
        return bool(self._order) and unit is self._order[-1]

    def opening(self, unit: Unit) -> None:
        """``unit`` opens: units not running are done with, as are gathers made for a unit
        that did not come (at most this unit and the one prefetched next stay gathered)."""
        for other in self.units:
            if other.state is _F and other.idle:
                other.close()
            elif other.state is _P and other is not unit:
                other.cancel()
        if unit not in self._seen:
            self._seen.append(unit)

    def end_forward(self) -> None:
        """The model's forward ended (or a new one starts): close what is still open
        (members skipped, or an earlier forward that raised), cancel unused prefetches."""
        for unit in self.units:
            unit.end_forward()
        if self._seen:  # backward runs this order in reverse; the next forward likely repeats it
            self._order, self._seen = self._seen, []

    def backward_started(self) -> None:
        """A plain backward reached a unit: run :meth:`end_backward` when it ends."""
        if not torch.is_grad_enabled() and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        self._queued = False
        agreement.count_backward()
        for unit in self.units:
            unit.end_backward()

    def after_step(self) -> None:
        self.holds.reset()
        for unit in self.units:
            unit.after_step()


class Unit:
    """A set of modules gathered and freed together; owns one or more flat shards."""

    def __init__(self, plan: UnitPlan, flats: list[FlatParam]) -> None:
        self.modules, self.flats, self.is_root = plan.modules, flats, plan.is_root
        self.frozen = [flat for flat in flats if not flat.shard.requires_grad]
        self._state = _S
        self._expected: set[nn.Module] = set(plan.modules)  # what the last forward ran
        self._ran: set[nn.Module] = set()  # members run in this forward
        self._waiting: set[nn.Module] = set()  # expected members still to run while open
        self._running = 0  # member forwards on the stack
        self._grad = False  # the bound views are differentiable (a graph may need them)
        self._graph = False  # this forward's outputs need a backward through the unit
        self._pending = 0  # post-backward nodes on member inputs that have not run yet
        self._bound: dict[tuple[nn.Module, str], torch.Tensor] = {}  # what bind() last set
        self._schedule: Schedule | None = None

    def join(self, schedule: Schedule) -> None:
        self._schedule = schedule
        if not self.is_root:  # the root's frozen flats are pinned to the backward's end
            for flat in self.flats:
                if flat.shard.requires_grad:
                    flat.set_on_reduce(self.reduced)

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            raise RuntimeError("internal error in metadist zero3/hsdp: a unit outside a model")
        return self._schedule

    @property
    def state(self) -> UnitState:
        return self._state

    def _to(self, new: UnitState) -> None:
        if new not in TRANSITIONS[self._state]:  # the message is built only when it raises
            names = "/".join(type(m).__name__ for m in self.modules[:3])
            check_transition(f"of {len(self.modules)} module(s) {names}", self._state, new)
        self._state = new

    @property
    def idle(self) -> bool:
        return self._running == 0

    @property
    def live(self) -> bool:
        """A backward is expected through this unit (what backward prefetch looks at)."""
        return self._pending > 0 or any(flat.live > 0 for flat in self.flats)

    @property
    def backward_done(self) -> bool:
        """No backward through this unit is known to be outstanding: frozen flats may go."""
        return self._pending <= 0 and self.state is not _F and all(
            f.live <= 0 for f in self.flats)

    # ----- gathering ------------------------------------------------------------------
    def _start_gather(self) -> bool:
        """Launch the all-gathers; True if one started (nothing was present or in flight)."""
        return any([flat.start_gather() for flat in self.flats])

    def _wait_gather(self) -> None:
        for flat in self.flats:
            flat.wait_gather()

    def _release(self) -> None:
        for flat in self.flats:
            flat.release()

    def _bind(self) -> None:
        """Point the modules' parameter attributes at fresh views of the gathered buffers:
        one differentiable unshard per buffer, shared by every member that reads it.

        An attribute that holds neither what the last bind put there nor a placeholder was
        set by the caller (``torch.func.functional_call`` with the user's module's names): the
        forward runs on it, as it would on a plain module, and a buffer none of whose
        attributes is left to bind is not gathered at all."""
        for flat in self.flats:
            uses = [[(module, attr) for module, attr in slot.uses
                     if self._ours(held_at(module, attr), self._bound.get((module, attr)))]
                    for slot in flat.slots]
            if not any(uses):
                continue
            views = flat.views(flat.unsharded(True))
            placed = [((module, attr), view)
                      for slot_uses, view in zip(uses, views, strict=True)
                      for module, attr in slot_uses]
            write((place_of(module, attr), view) for (module, attr), view in placed)
            self._bound.update(placed)
        self._grad = torch.is_grad_enabled()

    @staticmethod
    def _ours(current: torch.Tensor | None, bound: torch.Tensor | None) -> bool:
        return current is None or current is bound or current.is_meta

    # ----- forward --------------------------------------------------------------------
    def prefetch(self) -> None:
        """The unit before this one in the last forward's order opened: gather ahead."""
        if self.state is not _F and self._start_gather():
            self._to(_P)

    def cancel(self) -> None:
        """A prefetch whose forward did not come."""
        self._release()
        self._to(_S)

    def gather_for_step(self) -> None:
        """Root unit: gathered and bound when the model's forward starts, kept through the
        step (its parameters are read anywhere in the forward and the backward)."""
        self._bind()
        if self.state is not _G:
            self._to(_G)

    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A member's forward starts: open the unit if it is not (gather, bind, prefetch the
        next). Returns the member's inputs replaced when they carry a post-backward node."""
        if in_backward():
            self._recompute()
            return None
        if self.state is not _F:
            self._open()
        elif torch.is_grad_enabled() and not self._grad:
            self._bind()  # opened under no_grad: this member's graph needs its own unshard
        self._running += 1
        if not self.frozen or not torch.is_grad_enabled():
            return None
        # Frozen flats have no gradient to tell when backward is done with them: a node on
        # the member's inputs does.
        out = after_input_grads(args, kwargs, self.post_backward)
        if out is not None:
            self._pending += 1
        return out

    def _open(self) -> None:
        schedule = self.schedule
        schedule.opening(self)
        self._to(_F)
        self._waiting, self._graph = set(self._expected), False
        self._bind()
        nxt = schedule.next(self, +1)
        if schedule.prefetch and nxt is not None:
            nxt.prefetch()

    def _recompute(self) -> None:
        """Activation checkpointing's recomputation: the original graph's views need the
        buffer; reentrant checkpointing backpropagates through the recomputation."""
        self._wait_gather()
        self.schedule.holds.hold(self.frozen, recomputing=True)
        if torch.is_grad_enabled() and not self._grad:
            self._bind()
        else:  # the original graph's views, where freeing the buffer put placeholders
            write((place_of(module, attr), view) for (module, attr), view in self._bound.items()
                  if isinstance(held_at(module, attr), ShardedParam))

    def post_forward(self, member: nn.Module, output: Any) -> None:
        """A member's forward returned (or raised): close the unit once the members the
        last forward ran have all run and none is running."""
        if in_backward() or self.state is not _F:
            return
        if torch.is_grad_enabled():
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self._graph = True
                    t.register_hook(lambda g: self.pre_backward())
        self._running = max(self._running - 1, 0)  # 0 if its pre-hook raised before counting
        self._ran.add(member)
        self._waiting.discard(member)
        if self._running == 0 and not self._waiting:
            self.close()

    def close(self) -> None:
        """FORWARD -> GATHERED if a backward will read what is kept (the last unit of the
        forward, or ``reshard_after_forward=False``; frozen flats only if the outputs need a
        backward), else SHARDED."""
        schedule = self.schedule
        keep = not schedule.reshard_after_forward or schedule.is_last(self)
        kept = False
        for flat in self.flats:
            if keep and (self._grad if flat.shard.requires_grad else self._graph):
                kept = True
            else:
                flat.release()
        self._running = 0
        self._to(_G if kept else _S)

    def end_forward(self) -> None:
        if self.state is _F:
            self.close()
        elif self.state is _P:
            self.cancel()
        if self._ran:  # a forward that ran none of the unit's members teaches nothing
            self._expected, self._ran = self._ran, set()

    # ----- backward -------------------------------------------------------------------
    def pre_backward(self) -> None:
        """A backward reached the unit's outputs: gather what it reads, prefetch the unit
        before it. A unit a forward is using (PREFETCHED, FORWARD) stays with that forward."""
        schedule = self.schedule
        trainable = [flat for flat in self.flats if flat.shard.requires_grad]
        for flat in trainable:
            if flat.live > 0:
                flat.wait_gather()  # its unshard frees it again
        # the root unit's frozen flats are read anywhere in the backward: kept to its end
        schedule.holds.hold(self.frozen, pin=self.is_root)
        # A graph kept by retain_graph=True is read again after its unshard reduced (live
        # 0): gathered for this backward only. With create_graph=True the recorded graph
        # reads the trainable flats later too, and no hook gathers them then: pinned.
        schedule.holds.hold(trainable if torch.is_grad_enabled()
                            else [flat for flat in trainable if flat.live <= 0])
        prev = schedule.next(self, -1)
        if schedule.prefetch and prev is not None and prev.live:
            prev.prefetch_backward()
        if self.state in (_S, _G):
            self._to(_B)
        schedule.backward_started()

    def prefetch_backward(self) -> None:
        """The unit after this one in the forward started its backward: gather ahead (the
        unit's own pre_backward waits for it)."""
        self._start_gather()
        self.schedule.holds.hold(self.frozen, wait=False)

    def post_backward(self) -> None:
        """A member's input gradients are complete (its :class:`_PostBackward` ran)."""
        self._pending = max(self._pending - 1, 0)
        self.reduced()

    def reduced(self) -> None:
        """A trainable flat reduced, or a member's input gradients are complete: once no
        backward through the unit is outstanding (in a plain backward: one with
        ``create_graph=True`` pinned what it read), free the frozen flats."""
        if self.backward_done and not torch.is_grad_enabled():
            for flat in self.frozen:
                flat.release()  # a pinned one stays
            if self.state is _B:
                self._to(_S)

    def end_backward(self) -> None:
        """A plain backward ended: a unit it went through whose backward is complete holds
        no claim any more (one it stopped short of keeps its claim until the step)."""
        if self.state is _B and self.backward_done:
            self._to(_S)

    def after_step(self) -> None:
        """The shards changed: drop every gathered copy and the graphs' claims on them."""
        self._pending = 0
        for flat in self.flats:
            flat.after_step()
        if self.state is not _S:
            self._to(_S)


class _PostBackward(torch.autograd.Function):
    """Identity on a member's inputs; its backward runs once their gradients are complete,
    i.e. after every node of the member that leads to them."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.done = done
        ctx.set_materialize_grads(False)
        # New tensors, not the inputs (which autograd would make views of): a module may
        # still modify its input in place, as it could without this node.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.done()
        return (None, *grads)


def after_input_grads(args: tuple[Any, ...], kwargs: dict[str, Any],
                      done: Callable[[], None]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``(args, kwargs)`` with the tensors that require grad passed through
    :class:`_PostBackward` (``done`` runs in its backward); None if none requires grad."""
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return None
    for i, t in zip(where, _PostBackward.apply(done, *(leaves[i] for i in where)), strict=True):
        leaves[i] = t
    out: tuple[tuple[Any, ...], dict[str, Any]] = tree_unflatten(leaves, spec)
    return out
