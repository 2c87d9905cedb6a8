"""Counters of collective calls and bytes, read by tests and benchmarks.

``bytes`` is the payload a caller handed to the collective. ``wire_bytes`` is what a rank
sends on average under the bandwidth-optimal ring model: all_reduce 2B(N-1)/N, all_gather,
reduce_scatter and all_to_all B(N-1)/N of the full buffer, and B(N-1)/N for a rooted
broadcast, reduce, scatter or gather too (a pipelined chain carries B over N-1 links, shared
by N ranks). It is the yardstick the benchmarks compare against, a model, not a packet
capture.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class CommStats:
    """A snapshot: per-op counters and their totals."""

    ops: dict[str, OpStats] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.ops.values())

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.ops.values())

    @property
    def wire_bytes(self) -> float:
        return sum(s.wire_bytes for s in self.ops.values())

    def __sub__(self, other: CommStats) -> CommStats:
        out = CommStats()
        for name, s in self.ops.items():
            o = other.ops.get(name, OpStats())
            diff = OpStats(s.calls - o.calls, s.bytes - o.bytes, s.wire_bytes - o.wire_bytes)
            if diff.calls:
                out.ops[name] = diff
        return out


_lock = threading.Lock()
_totals: dict[str, OpStats] = {}


def ring_wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes a rank sends on average for ``op`` on ``nbytes`` of payload (the ring model)."""
    n = group_size
    if n <= 1 or op == "barrier" or op in ("recv", "irecv"):
        return 0.0
    if op in ("send", "isend"):  # point to point: the sender sends it all
        return float(nbytes)
    if op == "all_reduce":
        return 2.0 * nbytes * (n - 1) / n
    return float(nbytes) * (n - 1) / n


def record(op: str, nbytes: int, group_size: int) -> None:
    """Count one call of ``op`` moving ``nbytes`` of payload in a group of ``group_size``."""
    wire = ring_wire_bytes(op, nbytes, group_size)
    with _lock:
        s = _totals.setdefault(op, OpStats())
        s.calls += 1
        s.bytes += nbytes
        s.wire_bytes += wire


def snapshot() -> CommStats:
    """A copy of the counters since the process started (or the last :func:`reset`)."""
    with _lock:
        return CommStats({k: OpStats(v.calls, v.bytes, v.wire_bytes) for k, v in _totals.items()})


def reset() -> None:
    with _lock:
        _totals.clear()


@contextmanager
def counting() -> Iterator[CommStats]:
    """Count the collectives issued inside the block: ``with counting() as c: ...; c.calls``."""
    before = snapshot()
    result = CommStats()
    try:
        yield result
    finally:
        result.ops.update((snapshot() - before).ops)
