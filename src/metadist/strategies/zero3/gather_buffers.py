"""zero3/hsdp fast weights: the whole buffers gathers land in, reused (FSDP2's all-gather buffers).

A sharded meta-step gathers every unit several times (each forward, and again wherever a
backward reads a saved weight), each into a buffer of the unit's full size. Allocating each
afresh costs more than the copy into it: on the CPU a fresh buffer of megabytes is mapped
and faulted in page by page, and under glibc's default allocator the freed ones leave the
heap fragmented, so resident memory grows well past the live tensors.

[Note: reuse by ownership, not by schedule]
A buffer's users are autograd (a gather's views saved by a node that is not under
:func:`~metadist.strategies.zero3.shard_gather.saved_as_shards`), a gather started ahead, a
collective in flight, or a user holding a parameter view. No schedule can know when all of
them are done, so :class:`GatherBuffers` asks the storage itself: a buffer is handed out
again only while the pool's own tensor is its one holder. A buffer someone still reads is
never overwritten; the cost of being wrong is a fresh allocation, never a wrong value. A
buffer is handed out as a tensor of its own (a view of the pool's), so the caller counts as a
holder from the start, before it makes any view.

The pool keeps at most :data:`KEPT` buffers of each size: what is in flight at once (a unit
gathered, the next one started ahead, a forward's last unit kept for the backward, and a
backward's read with its neighbour ahead). Idle buffers are memory the program holds, like
an allocator's cache: :func:`metadist.testing.peak_bytes_of` counts them, and
:meth:`GatherBuffers.clear` lets them go.

Parts of a gradient that are zero (a parameter no gradient reached, the padding, the rest of
a buffer around one saved view's gradient) are read from one zero tensor per dtype and
device (:func:`zeros`), never written, so a reduce-scatter of parts needs no fill and no
copy (strategies/zero3/shard_gather.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

#: buffers of one size kept for reuse (see the module notes)
KEPT = 6

_Key = tuple[int, torch.dtype, torch.device]


def _sole_holder(buffer: Tensor) -> bool:
    """Only ``buffer`` itself (and its storage's Python object) refers to its storage:
    no view, saved tensor, collective or user reads it."""
    return bool(torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == 2)


@dataclass
class PoolCounts:
    """Buffers handed out, by whether a kept one was reused. (Tests and benchmarks read
    :data:`BUFFERS`'s.)"""

    reused: int = 0
    allocated: int = 0


class GatherBuffers:
    """Whole gather buffers by (size, dtype, device), reused once nothing else holds them."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._buffers: dict[_Key, list[Tensor]] = {}
        self._lock = threading.Lock()
        self.counts = PoolCounts()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer of ``numel`` elements nobody else holds, of unspecified contents."""
        key = (numel, dtype, torch.device(device))
        with self._lock:
            held = self._buffers.setdefault(key, [])
            for buffer in held:
                if _sole_holder(buffer):
                    self.counts.reused += 1
                    return buffer.view(-1)
            self.counts.allocated += 1
            out = torch.empty(numel, dtype=dtype, device=device)
            if len(held) < self.kept:
                held.append(out)
                # handed out as a tensor of its own: the caller is a holder the storage counts
                return out.view(-1)
            return out

    def idle_bytes(self) -> int:
        """Bytes of kept buffers nobody is using now."""
        with self._lock:
            return sum(b.nbytes for held in self._buffers.values() for b in held
                       if _sole_holder(b))

    def clear(self) -> None:
        """Let every kept buffer go (those in use live on with their users)."""
        with self._lock:
            self._buffers.clear()


BUFFERS = GatherBuffers()

_zeros: dict[tuple[torch.dtype, torch.device], Tensor] = {}
_zeros_lock = threading.Lock()


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``numel`` zeros, a view of a shared tensor that nobody may write: parts of a
    gradient that are zero, read by a reduce-scatter of parts."""
    key = (dtype, torch.device(device))
    with _zeros_lock:
        known = _zeros.get(key)
        if known is None or known.numel() < numel or known._version != 0:
            known = _zeros[key] = torch.zeros(max(numel, 1), dtype=dtype, device=device)
    return known[:numel]


def let_go() -> None:
    """Let every kept buffer and the zeros go: what memory measures do, so that a cache
    filled before them does not hide what a computation uses, nor one filled inside them
    look like memory it left alive."""
    BUFFERS.clear()
    with _zeros_lock:
        _zeros.clear()
