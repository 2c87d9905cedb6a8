"""The sharded meta-step a user can afford: its time against ddp's and its resident memory.

    python -m benchmarks.affordable_meta [--width 2048] [--depth 6] [--batch 32] [--ranks 2,4]
                                         [--steps 5] [--warmup 2] [--rounds 3]
                                         [--json PATH] [--quick]

benchmarks/sharded_meta.py's MLP and meta-step (3 unrolled SGD steps with create_graph, the
outer loss, backward, the optimizer's step), two ways: ddp with ``full_parameters()`` and
zero3 with ``model.fast_weights()``.

* **Time**, at each of ``--ranks``: each path's median of ``--steps`` meta-steps in processes
  of its own, over ``--rounds`` launches taking turns (medians). Beside it, the time of the
  same collectives alone (each path's collectives of one meta-step, counted, then replayed
  with nothing else running): where the ranks' compute and their exchanges cannot overlap
  (on this machine each rank's compute holds a core, and a loopback exchange needs a core
  too), the sharded path cannot be faster than ddp's compute plus its own collectives, the
  bound the table states.
* **Resident memory**: the growth of each rank's resident peak over the first meta-step after
  setup (the kernel's high-water mark), under metadist's allocator setting
  (runtime/resident.py) and under glibc's and torch's defaults, next to the live storages.

The targets: zero3 time at most 1.5 x ddp's at each N; zero3's resident growth at N = 2 at
most ddp's at N = 2, at N = 4 at most 0.35 x one process's (ddp at N = 1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import metadist
from benchmarks import sharded_meta as sm
from benchmarks.common import Results, output_args, parse, rotation, timed
from metadist.comm import ops, stats
from metadist.runtime import resident

PATHS = {"ddp": ("ddp", "gathered"), "zero3": ("zero3", "sharded")}


def _replay(counted: dict[str, tuple[int, int]]) -> float:
    """Seconds the collectives ``counted`` (op: calls, payload bytes in all) take alone."""
    n = metadist.world().world_size
    work = []
    for op, (calls, nbytes) in counted.items():
        per = -(-nbytes // (4 * calls * n)) * n  # float32 elements a call, split over n
        whole = torch.zeros(per)
        if op == "all_gather":
            mine = whole.narrow(0, 0, per // n).clone()
            work += [lambda w=whole, m=mine: ops.all_gather(w, m)] * calls
        elif op == "reduce_scatter":
            out = torch.empty(per // n)
            work += [lambda w=whole, o=out: ops.reduce_scatter(o, w, input_is_scratch=True)
                     ] * calls
        else:  # all_reduce, and any other by its payload
            work += [lambda w=whole: ops.all_reduce(w)] * calls

    def run() -> None:
        for call in work:
            call()

    run()  # warm-up: the connections' buffers
    return statistics.median(timed(run) for _ in range(3))


def _time_body(path: str, width: int, depth: int, batch: int, steps: int, warmup: int
               ) -> dict[str, float]:
    strategy, fast = PATHS[path]
    s, model, opt, x, y = sm._set_up(strategy, width, depth, batch)
    for _ in range(warmup):
        sm._step(s, model, opt, x, y, fast)
    t = statistics.median(timed(lambda: sm._step(s, model, opt, x, y, fast))
                          for _ in range(steps))
    with stats.counting() as counted:
        sm._step(s, model, opt, x, y, fast)
    alone = _replay({op: (o.calls, o.bytes) for op, o in counted.ops.items()})
    return {"time": t, "collectives": alone}


def _times(args: argparse.Namespace, n: int) -> dict[str, dict[str, float]]:
    """Per path: the median over launches of its meta-step and its collectives alone."""
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
    for i in range(args.rounds):
        for path in rotation(list(PATHS), i):
            samples[path].append(metadist.launch(
                _time_body, n, args=(path, args.width, args.depth, args.batch, args.steps,
                                     args.warmup), threads=1, timeout=3000)[0])
    return {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for p, rs in samples.items()}


def _memory(args: argparse.Namespace, setting: str) -> dict[tuple[str, int], dict[str, float]]:
    runs = [("ddp", 1), ("ddp", 2), ("zero3", 2), ("zero3", 4)]
    out = {}
    with sm._allocator(setting):
        for path, n in runs:
            strategy, fast = PATHS[path]
            out[(path, n)] = metadist.launch(
                sm._memory_body, n, args=(strategy, fast, args.width, args.depth, args.batch),
                threads=1, timeout=3000)[0]
    return out


def _verdict(value: float, target: float) -> str:
    return "yes" if value <= target else f"no (x{value / target:.2f} the target)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="the inner problem's global batch")
    ap.add_argument("--ranks", default="2,4", help="world sizes the times are taken at")
    ap.add_argument("--steps", type=int, default=5, help="timed meta-steps per launch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="launches per path, taking turns")
    output_args(ap)
    args = parse(ap, width=256, steps=2, warmup=1, rounds=1, ranks="2")
    started = time.perf_counter()
    with Results("affordable_meta", args) as out:
        rows, ratios = [], []
        for n in (int(r) for r in args.ranks.split(",")):
            t = _times(args, n)
            d, z = t["ddp"], t["zero3"]
            bound = (d["time"] - d["collectives"] + z["collectives"]) / d["time"]
            ratio = z["time"] / d["time"]
            rows.append((n, f"{d['time'] * 1e3:.0f}", f"{d['collectives'] * 1e3:.0f}",
                         f"{z['time'] * 1e3:.0f}", f"{z['collectives'] * 1e3:.0f}",
                         f"{ratio:.2f}", f"{bound:.2f}", _verdict(ratio, 1.5)))
            ratios.append({"ranks": n, "ddp": d, "zero3": z, "ratio": ratio,
                           "no_overlap_bound": bound})
        out.heading(f"meta-step time, zero3 fast_weights() against ddp: MLP {args.depth} x "
                    f"{args.width}, global batch {args.batch}, gloo, 1 thread per rank, "
                    f"{torch.get_num_threads()} cores seen by the launcher; allocator: "
                    f"{resident.setting()}")
        out.table(["ranks", "ddp ms", "ddp's collectives alone ms", "zero3 ms",
                   "zero3's collectives alone ms", "time ratio zero3 / ddp",
                   "bound without overlap (ddp - its collectives + zero3's) / ddp",
                   "within 1.5"], rows, key="time")
        out.data["time"] = ratios
        mem = {s: _memory(args, s) for s in ("metadist", "default")}
        rows, records = [], []
        for setting, m in mem.items():
            one, ddp2 = m[("ddp", 1)]["rss_max"], m[("ddp", 2)]["rss_max"]
            z2, z4 = m[("zero3", 2)]["rss_max"], m[("zero3", 4)]["rss_max"]
            words = sm._setting_words(setting)
            rows.append((words, f"{one:.0f}", f"{ddp2:.0f}", f"{z2:.0f}", f"{z4:.0f}",
                         f"{m[('zero3', 4)]['live_max']:.0f}", f"{z2 / ddp2:.2f}",
                         _verdict(z2, ddp2), f"{z4 / one:.2f}", _verdict(z4, 0.35 * one)))
            records.append({"allocator": words, **{f"{p}_{n}": v for (p, n), v in m.items()}})
        out.heading("resident peak growth of the first meta-step after setup (MiB, the "
                    "rank that grew most)")
        out.table(["allocator", "ddp N=1", "ddp N=2", "zero3 N=2", "zero3 N=4",
                   "zero3 N=4 live storages", "zero3 / ddp at N=2", "within 1.0",
                   "zero3 N=4 / one process", "within 0.35"], rows, key="memory")
        out.data["memory"] = records
        out.note(f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
