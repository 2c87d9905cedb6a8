"""Flats gathered for a backward that no unshard frees (zero3/hsdp).

A *trainable* flat is freed by its unshard's backward (the reduce-scatter). Some buffers a
backward reads have no such node to free them: frozen flats (``requires_grad=False``),
trainable flats read again through a graph kept by ``retain_graph=True`` after their
unshard already reduced, and whatever a ``create_graph=True`` backward records (a later
backward reads it again, and no hook gathers it then). :class:`BackwardHolds` gathers them,
frees them when the plain backward ends, or *pins* them (the flat's own
:meth:`~metadist.strategies.zero3.flat.FlatParam.pin`) until a plain backward ends (at the latest
until the optimizer step). It only calls the flats' methods; which unit is in a forward is
asked of the units (``busy``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from metadist.strategies.zero3.flat import FlatParam


class BackwardHolds:
    """Flats gathered for a backward that no unshard frees (frozen ones, and trainable ones
    read again through a retained or recorded graph): freed when it ends, or pinned past it."""

    def __init__(self, busy: Callable[[FlatParam], bool]) -> None:
        self._busy = busy  # its unit is in a forward now: leave it to the forward's hooks
        self._held: set[FlatParam] = set()  # gathered by the plain backward now running
        self._pinned: set[FlatParam] = set()  # kept until a plain backward ends
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
                flat.pin()
                self._pinned.add(flat)
            self._held.add(flat)
        if not create_graph and (self._held or self._pinned) and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        """A plain backward ended: free what it gathered and what recorded graphs read."""
        self._queued = False
        for flat in self._held | self._pinned:
            if not self._busy(flat):
                self._pinned.discard(flat)
                flat.unpin()
                flat.release()
        self._held.clear()

    def reset(self) -> None:
        """The shards changed (the flats drop their pins themselves): forget every hold."""
        self._held.clear()
        self._pinned.clear()
