"""Collectives on gloo: fused vs one-by-one small all-reduces, bandwidth by message size, and
the backend-aware all_gather / reduce_scatter against torch's native ones.

    python -m benchmarks.comm [--world 2] [--reps 10] [--json PATH] [--quick]
    python -m benchmarks.comm --debug   # per-call cost of comm's tracking and of debug mode
    python -m benchmarks.comm --latency # both (what `metadist bench` runs)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import metadist
from benchmarks.common import Results, alternate, output_args, parse
from metadist import comm

# Message sizes: (bandwidth MiB, primitives MiB, per-call latency bytes), full and --quick.
SIZES = {False: ((0.0625, 0.25, 1, 4, 16, 64), (4, 25), (4, 4096, 1 << 18, 1 << 22)),
         True: ((0.0625, 1), (1,), (4, 4096))}


def _primitives(full: torch.Tensor, shard: torch.Tensor, reps: int,
                warmup: int) -> dict[str, float]:
    return alternate({
        "all_gather auto": lambda: comm.all_gather(full, shard),
        "all_gather native": lambda: comm.all_gather(full, shard, impl="native"),
        "reduce_scatter auto, input is scratch": lambda: comm.reduce_scatter(
            shard, full, input_is_scratch=True),
        "reduce_scatter native": lambda: comm.reduce_scatter(shard, full, impl="native"),
        "all_reduce": lambda: comm.all_reduce(full),
    }, reps, warmup)


def _body(reps: int, warmup: int = 2, quick: bool = False,
          latency: bool = False) -> dict[str, object]:
    n = metadist.world().world_size
    bandwidth_sizes, prim_sizes, _ = SIZES[quick]
    small = [torch.randn(1024) for _ in range(256)]  # 256 tensors of 4 KiB

    def one_by_one() -> None:
        for t in small:
            comm.all_reduce(t)

    fused = alternate({"one-by-one": one_by_one,
                       "fused": lambda: comm.fused_all_reduce(small)}, reps, warmup, inner=3)
    bandwidth = []
    for mib in bandwidth_sizes:
        x = torch.randn(int(mib * 2**20) // 4)
        inner = max(1, int(8 / mib))  # amortise the barriers on small messages
        t = alternate({"ar": lambda x=x: comm.all_reduce(x)}, reps, warmup, inner=inner)["ar"]
        bus = 2 * (n - 1) / n * x.numel() * 4 / t / 1e9
        bandwidth.append((mib, t * 1e3, x.numel() * 4 / t / 1e9, bus))
    prims = []
    for mib in prim_sizes:
        full = torch.randn(int(mib * 2**20) // 4 // n * n)
        prims.append((mib, _primitives(full, torch.randn(full.numel() // n), reps, warmup)))
    out: dict[str, object] = {"fused": fused, "bandwidth": bandwidth, "prims": prims}
    if latency:
        out["latency"] = _latency(reps, warmup, quick)
    return out


def _tracking_alone(calls: int = 100_000) -> float:
    """Seconds per tracker enter + exit pair: the watchdog's whole hot-path cost."""
    import time

    from metadist.runtime.tracker import TRACKER

    pg = dist.group.WORLD
    start = time.perf_counter()
    for _ in range(calls):
        TRACKER.exit(TRACKER.enter("all_reduce", pg))
    return (time.perf_counter() - start) / calls


def _latency(reps: int, warmup: int = 2,
             quick: bool = False) -> tuple[float, list[tuple[str, float, float, float]]]:
    """Per-call seconds of an all-reduce: torch directly, through comm (watchdog tracking),
    and through comm in debug mode (one fingerprint all-gather more per call)."""
    alone = _tracking_alone(5_000 if quick else 100_000)
    rows = []
    for nbytes in SIZES[quick][2]:
        x = torch.ones(nbytes // 4)
        inner = max(2, min(200, (1 << 22) // nbytes))

        def debug_on(x: torch.Tensor = x) -> None:
            comm.set_debug(True)
            try:
                comm.all_reduce(x)
            finally:
                comm.set_debug(False)

        t = alternate({"torch": lambda x=x: dist.all_reduce(x),
                       "comm": lambda x=x: comm.all_reduce(x),
                       "debug": debug_on}, reps, warmup, inner=inner)
        rows.append((f"{nbytes} B" if nbytes < 1024 else f"{nbytes // 1024} KiB",
                     t["torch"], t["comm"], t["debug"]))
    return alone, rows


def _report_latency(out: Results, alone: float, rows: list[tuple[str, float, float, float]],
                    world: int, reps: int) -> None:
    out.heading(f"Per-call all-reduce latency on gloo, world size {world} (medians of {reps}, "
                "alternating)")
    out.note(f"watchdog tracking alone (tracker enter + exit): {alone * 1e6:.2f} us per call\n")
    out.table(["payload", "torch.distributed us", "comm us", "comm debug us",
               "comm vs torch", "debug vs comm"],
              [(size, a * 1e6, b * 1e6, c * 1e6, f"{(b - a) / a:+.1%}", f"{(c - b) / b:+.1%}")
               for size, a, b, c in rows], key="latency")
    out.data["latency"] = {"tracking_us": alone * 1e6, "rows": [
        {"payload": size, "torch_us": a * 1e6, "comm_us": b * 1e6, "debug_us": c * 1e6,
         "comm_over_torch": b / a, "debug_over_comm": c / b} for size, a, b, c in rows]}


def _report(out: Results, res: dict[str, Any], world: int, reps: int) -> None:
    fused = res["fused"]
    out.heading(f"Collectives on gloo, world size {world} (medians of {reps}, "
                "alternating, warm-up discarded)")
    speedup = fused["one-by-one"] / fused["fused"]
    out.table(["256 x 4 KiB all-reduce", "ms", "speed-up"], [
        ("one collective per tensor", fused["one-by-one"] * 1e3, 1.0),
        ("fused (one per 25 MiB bucket)", fused["fused"] * 1e3, speedup),
    ], key="fused")
    out.table(["all-reduce MiB", "ms", "algbw GB/s", "busbw GB/s"], res["bandwidth"],
              key="bandwidth")
    rows = [(f"{mib} MiB", name, t * 1e3) for mib, times in res["prims"] for name, t in
            times.items()]
    out.table(["full buffer", "primitive", "ms"], rows, key="primitives")
    out.data.update(world=world, fused={
        "one_by_one_ms": fused["one-by-one"] * 1e3, "fused_ms": fused["fused"] * 1e3,
        "speedup": speedup}, bandwidth=[
        {"mib": mib, "ms": ms, "algbw_gbps": alg, "busbw_gbps": bus}
        for mib, ms, alg, bus in res["bandwidth"]], primitives=[
        {"buffer_mib": mib, "primitive": name, "ms": ms} for mib, name, ms in
        [(m, p, t * 1e3) for m, times in res["prims"] for p, t in times.items()]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions (medians)")
    ap.add_argument("--warmup", type=int, default=2, help="repetitions discarded first")
    ap.add_argument("--debug", action="store_true",
                    help="only measure comm's per-call tracking and debug-mode overhead")
    ap.add_argument("--latency", action="store_true",
                    help="measure the per-call tracking and debug-mode overhead too, after "
                         "the collectives")
    output_args(ap)
    args = parse(ap, reps=2, warmup=1)
    with Results("comm", args) as out:  # JSON also of what ran before a failure
        if args.debug:
            alone, rows = metadist.launch(_latency, args.world, args=(args.reps, args.warmup,
                                                                      args.quick), threads=1)[0]
            _report_latency(out, alone, rows, args.world, args.reps)
        else:
            res = metadist.launch(_body, args.world, args=(args.reps, args.warmup, args.quick,
                                                           args.latency), threads=1)[0]
            _report(out, res, args.world, args.reps)
            if args.latency:
                _report_latency(out, *res["latency"], args.world, args.reps)


if __name__ == "__main__":
    main()
