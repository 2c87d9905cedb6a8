"""Finishing a backward's asynchronous reduce-scatters (zero3/hsdp flat shards).

In a plain ``.backward()`` each flat's unshard launches its gradient's reduce-scatter and
returns; the result is added into ``shard.grad`` when the next one is launched (by then it
had a unit's backward to progress, and its input buffer is freed early) or when the
backward ends, whichever comes first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from metadist.comm.handle import Handle

if TYPE_CHECKING:
    from metadist.strategies.zero3.flat import FlatParam


class BackwardCoordinator:
    """Finishes the asynchronous reduce-scatters of a backward pass: each one when the next
    is launched (it had a unit's backward to progress, and its input buffer is freed early)
    and the last when backward ends."""

    def __init__(self) -> None:
        self._pending: list[tuple[FlatParam, torch.Tensor, Handle, list[bool] | None]] = []
        self._queued = False

    def defer(self, flat: FlatParam, out: torch.Tensor, handle: Handle,
              reach: list[bool] | None) -> None:
        """Finish ``flat``'s reduce-scatter into ``out`` later; ``reach``: the slots it
        carries a gradient for."""
        self._drain()
        self._pending.append((flat, out, handle, reach))
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for flat, out, handle, reach in pending:
            flat.finish(out, handle)
            flat.accumulate(out, reach)

    def _end(self) -> None:
        self._queued = False
        self._drain()
