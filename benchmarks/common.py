"""Shared timing and reporting helpers for the benchmarks."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import metadist
from benchmarks import PEERS, device
from benchmarks.tables import table
from metadist import comm


def timed(fn: Callable[[], object], inner: int = 1) -> float:
    """Seconds per call of ``fn``, every rank starting together; ``inner`` back-to-back calls
    amortise the two barriers that bracket the measurement. On CUDA the GPU is drained
    before the clock starts and before it stops."""
    cuda = device.on_cuda()
    device.synchronize(cuda)
    comm.barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    device.synchronize(cuda)
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


def run_jobs(body: Callable[..., Any], jobs: Sequence[tuple[Any, ...]], world: int,
             quick: bool, timeout: float = 3000) -> list[Any]:
    """Rank 0's result of ``body(*job)`` for each job. Normally every job gets fresh
    processes (one launch each, as the published figures were measured); under ``--quick``
    one pool runs them all, so the ranks' start-up and first-use imports are paid once."""
    if not quick:
        return [metadist.launch(body, world, args=job, threads=1, timeout=timeout)[0]
                for job in jobs]
    with metadist.RankPool(world, threads=1, timeout=timeout) as pool:
        return [pool.run(body, job, timeout=timeout)[0] for job in jobs]


def use_peers() -> bool:
    """Put ``.bench/`` on the path *after* ours (a wheel there ships a ``benchmarks`` package
    too); False when it is not installed, so the anchor rows it provides are skipped."""
    if not PEERS.is_dir():
        return False
    if str(PEERS) not in sys.path:
        sys.path.append(str(PEERS))
    return True


def output_args(ap: argparse.ArgumentParser) -> None:
    """The options every benchmark shares: machine-readable output and the CI-sized run."""
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the results (every figure of the tables) as JSON here")
    ap.add_argument("--quick", action="store_true",
                    help="tiny models, 2 steps, 1 warm-up: checks the pipeline, not the speed")


def parse(ap: argparse.ArgumentParser, **small: Any) -> argparse.Namespace:
    """Parse the command line; under ``--quick`` the defaults become ``small`` (fewer steps,
    fewer sizes), options given explicitly still win."""
    first, _ = ap.parse_known_args()
    if first.quick:
        ap.set_defaults(**small)
    return ap.parse_args()


def environment() -> dict[str, Any]:
    """Where the figures were measured: they mean little without it."""
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            **device.environment()}


def _plain(value: Any) -> Any:
    """JSON-safe copy: NaN/inf (an anchor that did not run) become null, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class Results:
    """What a benchmark prints, kept for ``--json``: the tables exactly as printed (raw
    values, so no figure is lost to formatting) plus structured ``data`` for plots."""

    def __init__(self, benchmark: str, args: argparse.Namespace) -> None:
        self.benchmark, self.args = benchmark, args
        self.title = ""
        self.tables: list[dict[str, Any]] = []
        self.notes: list[dict[str, str]] = []
        self.skipped: list[str] = []
        self.data: dict[str, Any] = {}
        self.error: str | None = None

    def __enter__(self) -> Results:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        """Write the JSON even when the benchmark fails: the tables measured before the
        failure still reach the report, next to the error."""
        if exc is not None:
            self.error = "".join(traceback.format_exception_only(exc)).strip()
        self.write()

    def heading(self, title: str) -> None:
        """Start a section: the following tables belong to it."""
        self.title = title
        print(f"## {title}\n")

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]],
              key: str = "") -> None:
        print(table(headers, rows))
        print()
        self.tables.append({"key": key, "title": self.title, "columns": list(headers),
                            "rows": [list(r) for r in rows]})

    def note(self, text: str) -> None:
        print(text)
        self.notes.append({"title": self.title, "text": text.strip()})

    def skip(self, what: str, why: str) -> None:
        """An anchor that could not run: said on stdout and listed in the report."""
        print(f"({what} skipped: {why})\n")
        self.skipped.append(f"{what}: {why}")

    def write(self) -> None:
        if not self.args.json:
            return
        settings = {k: v for k, v in vars(self.args).items() if k != "json"}
        payload = {"benchmark": self.benchmark, "settings": settings,
                   "environment": environment(), "tables": self.tables, "notes": self.notes,
                   "skipped": self.skipped, "data": self.data, "error": self.error}
        path = Path(self.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_plain(payload), indent=1) + "\n")
