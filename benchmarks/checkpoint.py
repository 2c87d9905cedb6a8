"""Checkpoint save and load: sharded vs full format, time and bytes written.

    python -m benchmarks.checkpoint [--world 2] [--reps 5] [--strategies ddp,zero2,zero3]
                                    [--json PATH] [--quick]

The 25.2M-parameter MLP of the anchors with Adam (after one step, so the optimizer state
exists: parameters 96 MiB + moments 192 MiB). For each strategy the four operations (save
sharded, save full, load sharded, load full) take turns, their order rotated every
repetition; warm-up discarded, medians. Saves include every fsync and the atomic commit.
Loads read files that were just written (warm page cache): they measure assembling and
validating (checksums) more than the disk.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import metadist
from benchmarks.common import Results, output_args, parse, rotation, run_jobs, timed
from benchmarks.models import param_count, workload, zero3_unit_params


def _bytes(path: Path, world: int) -> list[int]:
    """Bytes written per rank: its data file (rank 0 also the index and objects) or the file."""
    if path.is_file():
        return [path.stat().st_size] + [0] * (world - 1)
    data = next(p for p in path.iterdir() if p.name.startswith("v-"))
    out = [(data / f"rank-{r:05d}.bin").stat().st_size for r in range(world)]
    out[0] += (data / "objects.pt").stat().st_size + (path / "metadata.json").stat().st_size
    return out


def _body(strategy: str, directory: str, reps: int, warmup: int,
          quick: bool = False) -> dict[str, Any]:
    factory, data, loss_fn = workload("mlp", quick)
    model = factory()
    params = param_count(model)  # before zero3 empties the module's own parameters
    options = {"min_unit_params": zero3_unit_params(quick)} if strategy == "zero3" else {}
    s = metadist.strategy(strategy, **options)
    wrapped, opt = s.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    x, y = data(metadist.world().rank)[0]
    s.backward(loss_fn(wrapped(x), y))
    opt.step()
    state = {"model": wrapped, "optimizer": opt, "step": 1}
    paths = {"sharded": Path(directory) / f"{strategy}-sharded",
             "full": Path(directory) / f"{strategy}-full.pt"}

    def saver(fmt: str, path: Path) -> Callable[[], object]:
        return lambda: s.save(path, state, format=fmt)

    def loader(path: Path) -> Callable[[], object]:
        return lambda: s.load(path, state)

    ops: dict[str, Callable[[], object]] = {}
    for fmt, path in paths.items():
        ops[f"save {fmt}"], ops[f"load {fmt}"] = saver(fmt, path), loader(path)
    for fmt, path in paths.items():  # the loads need a checkpoint from the first repetition
        s.save(path, state, format=fmt)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for i in range(warmup + reps):
        for name in rotation(list(ops), i):
            t = timed(ops[name])
            if i >= warmup:
                samples[name].append(t)
    world = metadist.world().world_size
    return {"median": {k: statistics.median(v) for k, v in samples.items()},
            "bytes": {fmt: _bytes(path, world) for fmt, path in paths.items()},
            "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (medians)")
    ap.add_argument("--warmup", type=int, default=1, help="repetitions discarded first")
    ap.add_argument("--strategies", default="ddp,zero2,zero3", help="comma-separated")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    output_args(ap)
    args = parse(ap, reps=2, warmup=1)
    with Results("checkpoint", args) as out:  # JSON also of what ran before a failure
        directory = tempfile.mkdtemp(prefix="metadist-ckpt-", dir=args.dir)
        strategies = args.strategies.split(",")
        jobs = [(strategy, directory, args.reps, args.warmup, args.quick)
                for strategy in strategies]
        try:
            results = run_jobs(_body, jobs, args.world, args.quick)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        rows, records = [], []
        for strategy, res in zip(strategies, results, strict=True):
            for fmt in ("sharded", "full"):
                per_rank = res["bytes"][fmt]
                save, load = res["median"][f"save {fmt}"] * 1e3, res["median"][f"load {fmt}"] * 1e3
                rows.append((strategy, fmt, save, load, sum(per_rank) / 2**20,
                             " / ".join(f"{b / 2**20:.1f}" for b in per_rank)))
                records.append({"strategy": strategy, "format": fmt, "save_ms": save,
                                "load_ms": load, "written_bytes": sum(per_rank),
                                "per_rank_bytes": per_rank})
        out.heading(f"checkpoints of the MLP ({res['params'] / 1e6:.1f}M params) with Adam, world "
                    f"size {args.world}, gloo, 1 thread per rank (medians of {args.reps}, "
                    "alternating)")
        out.table(["strategy", "format", "save ms", "load ms", "written MiB",
                   "per rank MiB (rank 0 / 1 / ...)"], rows, key="checkpoint")
        out.data = {"world": args.world, "params": res["params"], "rows": records}


if __name__ == "__main__":
    main()
