"""Shared timing and reporting helpers for the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from metadist import comm


def timed(fn: Callable[[], object], inner: int = 1) -> float:
    """Seconds per call of ``fn``, every rank starting together; ``inner`` back-to-back calls
    amortise the two barriers that bracket the measurement."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    comm.barrier()
    return (time.perf_counter() - start) / inner


def rotation(names: Sequence[str], i: int) -> list[str]:
    """Repetition ``i``'s order: rotated each time, so every configuration follows every
    other one equally often (what ran just before, e.g. its cache footprint, averages out)."""
    k = i % len(names) if names else 0
    return [*names[k:], *names[:k]]


def alternate(configs: dict[str, Callable[[], object]], reps: int,
              warmup: int = 2, inner: int = 1) -> dict[str, float]:
    """Median seconds per config; configs take turns each repetition, warm-up discarded."""
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for i in range(warmup + reps):
        for name in rotation(list(configs), i):
            t = timed(configs[name], inner)
            if i >= warmup:
                samples[name].append(t)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
