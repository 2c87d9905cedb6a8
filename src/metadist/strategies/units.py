"""zero3/hsdp units, and how long their gathered parameters live in backward.

A :class:`Unit` is a set of modules gathered and freed together; it owns one flat shard per
dtype, optimizer group and ``requires_grad`` (strategies/flat.py). A *trainable* flat enters
autograd through the unshard node, whose backward (the gradient's reduce-scatter) runs after
every node that read its parameters: that is where it is freed. A *frozen* flat
(``requires_grad=False``) has no such node, yet the backward through its layers reads it
(the gradient of a linear layer's input is ``grad_out @ W``), so:

* the unit's pre-backward hook (on its forward outputs) gathers it whenever a backward goes
  through the unit, and the unit before it is prefetched with it. A unit whose outputs need
  no gradient (frozen layers at the start of a model) gets no backward: freed after its
  forward whatever ``reshard_after_forward`` says;
* each member forward whose inputs require grad passes them through :class:`_PostBackward`,
  an identity whose backward runs once the member's input gradients are complete (FSDP2's
  post-backward hook). When those have run for every forward through the unit (``pending``)
  and the unit's trainable flats have reduced, the unit's backward is over and the frozen
  flats are freed: one unit at a time, as for trainable ones;
* a backward with ``create_graph=True`` records nodes that read the weights again in a later
  backward: the frozen flats it reads are *pinned* (kept gathered) until the next plain
  backward ends (at the latest until the optimizer step). Those of the root unit and of
  ``functional_forward`` graphs, which have no per-unit post-backward, are pinned until the
  backward that reads them ends;
* whatever a plain backward gathered of frozen flats and is still gathered when it ends is
  freed then (a backward that stopped short of a unit's inputs, e.g. ``autograd.grad`` with
  respect to an inner tensor).

Frozen flats have no gradient, so no reduce-scatter and no gradient memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from metadist.strategies.flat import FlatParam
from metadist.strategies.wrap import UnitPlan


def in_backward() -> bool:
    """True inside an autograd backward, where a forward is activation checkpointing's
    recomputation (non-reentrant: it refills saved tensors of the original graph)."""
    return bool(torch._C._current_graph_task_id() != -1)


class Unit:
    """A set of modules gathered and freed together; owns one or more flat shards.

    Per forward a unit is *open* from the first of its members to run until it is closed:
    when the members expected to run have run and none is running, when another unit opens
    while none of its members runs, or when the model's forward ends.
    """

    def __init__(self, plan: UnitPlan, flats: list[FlatParam]) -> None:
        self.modules, self.flats, self.is_root = plan.modules, flats, plan.is_root
        self.frozen = [flat for flat in flats if not flat.shard.requires_grad]
        self.expected: set[nn.Module] = set(plan.modules)  # what the last forward ran
        self.ran: set[nn.Module] = set()  # members run in this forward
        self.waiting: set[nn.Module] = set()  # expected members still to run while open
        self.running = 0  # member forwards on the stack
        self.open = False
        self.grad = False  # the bound views are differentiable (a graph may need them)
        self.graph = False  # this forward's outputs need a backward through the unit
        self.pending = 0  # post-backward nodes on member inputs that have not run yet
        self._bound: dict[tuple[nn.Module, str], torch.Tensor] = {}  # what bind() last set

    def start_gather(self) -> bool:
        """Launch the all-gathers; True if one started (nothing was present or in flight)."""
        return any([flat.start_gather() for flat in self.flats])

    def wait_gather(self) -> None:
        for flat in self.flats:
            flat.wait_gather()

    def bind(self) -> None:
        """Point the modules' parameter attributes at fresh views of the gathered buffers:
        one differentiable unshard per buffer, shared by every member that reads it.

        An attribute that holds neither what the last bind put there nor a placeholder was
        set by the caller (``torch.func.functional_call`` with the user's module's names): the
        forward runs on it, as it would on a plain module, and a buffer none of whose
        attributes is left to bind is not gathered at all."""
        for flat in self.flats:
            uses = [[(module, attr) for module, attr in slot.uses
                     if self._ours(module.__dict__.get(attr), self._bound.get((module, attr)))]
                    for slot in flat.slots]
            if not any(uses):
                continue
            for slot_uses, view in zip(uses, flat.views(flat.unsharded(True)), strict=True):
                for module, attr in slot_uses:
                    module.__dict__[attr] = view
                    self._bound[(module, attr)] = view
        self.grad = torch.is_grad_enabled()

    @staticmethod
    def _ours(current: torch.Tensor | None, bound: torch.Tensor | None) -> bool:
        return current is None or current is bound or current.is_meta

    def free(self) -> None:
        for flat in self.flats:
            flat.release()

    @property
    def live(self) -> bool:
        """A backward is expected through this unit (what backward prefetch looks at)."""
        return self.pending > 0 or any(flat.live > 0 for flat in self.flats)

    @property
    def backward_done(self) -> bool:
        """No backward through this unit is known to be outstanding: frozen flats may go."""
        return self.pending <= 0 and not self.open and all(f.live <= 0 for f in self.flats)


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


class BackwardHolds:
    """Flats gathered for a backward that no unshard frees (frozen ones, and trainable ones
    read again through a retained or recorded graph): freed when it ends, or pinned past it."""

    def __init__(self, busy: Callable[[FlatParam], bool]) -> None:
        self.busy = busy  # its unit is in a forward now: leave it to the forward's hooks
        self.held: set[FlatParam] = set()  # gathered by the plain backward now running
        self.pinned: set[FlatParam] = set()  # kept until a plain backward ends
        self._queued = False
        self._mode = (-1, False)  # (graph task, create_graph) the last hook saw

    def hold(self, flats: Iterable[FlatParam], *, wait: bool = True, pin: bool = False,
             recomputing: bool = False) -> None:
        """Gather ``flats`` for the backward now running. ``pin``: keep them until
        it ends (no per-unit post-backward frees them). In a backward with
        ``create_graph=True`` they are pinned until a plain backward ends: the graph it
        records reads them again. The grad mode tells which backward this is, except in
        a recomputation (checkpointing enables grad): there the mode the backward's hooks
        last saw is used (pinned if unknown)."""
        task = torch._C._current_graph_task_id()
        if recomputing:
            create_graph = self._mode[1] if self._mode[0] == task else True
        else:
            create_graph = torch.is_grad_enabled()
            self._mode = (task, create_graph)
        for flat in flats:
            if wait:
                flat.wait_gather()
            else:
                flat.start_gather()
            if pin or create_graph:
                flat.pinned = True
                self.pinned.add(flat)
            self.held.add(flat)
        if not create_graph and (self.held or self.pinned) and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        """A plain backward ended: free what it gathered and what recorded graphs read."""
        self._queued = False
        for flat in self.held | self.pinned:
            if not self.busy(flat):
                flat.pinned = False
                self.pinned.discard(flat)
                flat.release()
        self.held.clear()

    def reset(self) -> None:
        for flat in self.pinned:
            flat.pinned = False
        self.held.clear()
        self.pinned.clear()
