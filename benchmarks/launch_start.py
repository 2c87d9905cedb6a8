"""What starting ranks costs: ``launch()``'s ranks forked from its server against spawned ones.

    python -m benchmarks.launch_start [--worlds 1,2,3,4] [--reps 7] [--warmup 1]
                                      [--json PATH] [--quick]

A launch whose function returns at once, timed from the call to its results, per world size:
its ranks spawned (a fresh interpreter each, importing torch and metadist) and forked from the
server that imported them once (``launch()``'s default on Linux). The two take turns, warm-up
discarded, medians. The ranks' CPU is their own, summed over ranks (user and system, from each
rank's start to its return). The server is started once per program: a new program's first
launch is timed on its own, each way, in a process of its own per repetition.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import metadist
from benchmarks import ROOT
from benchmarks.common import Results, output_args, parse, rotation

METHODS = {"spawned": "spawn", "forked from the server": None}
_FIRST_LAUNCH = (
    "import time\n"
    "import metadist\n"
    "from benchmarks.launch_start import rank_cpu_ms\n"
    "start = time.perf_counter()\n"
    "metadist.launch(rank_cpu_ms, {world}, start_method={method!r}, threads=1)\n"
    "print(time.perf_counter() - start)\n")


def rank_cpu_ms() -> float:
    """This rank's CPU since it started (a forked process's count starts at the fork)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return (use.ru_utime + use.ru_stime) * 1e3


def _later_launch(world: int, method: str | None) -> tuple[float, float]:
    start = time.perf_counter()
    cpu = metadist.launch(rank_cpu_ms, world, start_method=method, threads=1)
    return (time.perf_counter() - start) * 1e3, sum(cpu)


def _first_launch(world: int, method: str | None) -> float:
    out = subprocess.run([sys.executable, "-c", _FIRST_LAUNCH.format(world=world,
                                                                     method=method)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    return float(out.stdout.split()[-1]) * 1e3


def _medians(samples: dict[str, list[Any]]) -> dict[str, Any]:
    return {k: statistics.median(v) if not isinstance(v[0], tuple) else
            tuple(statistics.median(x) for x in zip(*v, strict=True))
            for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    output_args(ap)
    args = parse(ap, worlds="1,2", reps=2, warmup=1)
    worlds = [int(w) for w in args.worlds.split(",")]
    with Results("launch_start", args) as results:
        later: dict[int, dict[str, Any]] = {}
        for world in worlds:
            samples: dict[str, list[Any]] = {name: [] for name in METHODS}
            for i in range(args.warmup + args.reps):
                for name in rotation(list(METHODS), i):
                    got = _later_launch(world, METHODS[name])
                    if i >= args.warmup:
                        samples[name].append(got)
            later[world] = _medians(samples)
        results.heading(f"launch() of a function that returns at once, in a program that "
                        f"launched before (gloo, a thread per rank): medians of {args.reps}, "
                        f"taking turns")
        spawned, forked = METHODS
        rows = [[w, f"{later[w][spawned][0]:.0f}", f"{later[w][forked][0]:.0f}",
                 f"{later[w][spawned][0] / later[w][forked][0]:.1f}",
                 f"{later[w][spawned][1]:.0f}", f"{later[w][forked][1]:.0f}"] for w in worlds]
        results.table(["ranks", "spawned ms", "forked ms", "speed-up", "spawned ranks' CPU ms",
                       "forked ranks' CPU ms"], rows, key="later")
        first: dict[str, list[float]] = {name: [] for name in METHODS}
        world = max(worlds)
        for i in range(args.warmup + args.reps):
            for name in rotation(list(METHODS), i):
                t = _first_launch(world, METHODS[name])
                if i >= args.warmup:
                    first[name].append(t)
        firsts = _medians(first)
        results.heading(f"A program's first launch() of {world} ranks, from the call (the "
                        f"server starts and imports metadist here): medians of {args.reps}, "
                        f"a program each, taking turns")
        results.table(["ranks", "spawned ms", "forked ms (server start included)"],
                      [[world, f"{firsts[spawned]:.0f}", f"{firsts[forked]:.0f}"]],
                      key="first")
        results.data = {"later": {str(w): later[w] for w in worlds}, "first": firsts}


if __name__ == "__main__":
    main()
