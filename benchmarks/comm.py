"""Collectives on gloo: fused vs one-by-one small all-reduces, bandwidth by message size, and
the backend-aware all_gather / reduce_scatter against torch's native ones.

    python -m benchmarks.comm [--world 2] [--reps 10]
    python -m benchmarks.comm --debug   # per-call cost of comm's tracking and of debug mode
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import metadist
from benchmarks.common import alternate, table
from metadist import comm


def _primitives(full: torch.Tensor, shard: torch.Tensor, reps: int) -> dict[str, float]:
    return alternate({
        "all_gather auto": lambda: comm.all_gather(full, shard),
        "all_gather native": lambda: comm.all_gather(full, shard, impl="native"),
        "reduce_scatter auto, input is scratch": lambda: comm.reduce_scatter(
            shard, full, input_is_scratch=True),
        "reduce_scatter native": lambda: comm.reduce_scatter(shard, full, impl="native"),
        "all_reduce": lambda: comm.all_reduce(full),
    }, reps)


def _body(reps: int) -> dict[str, object]:
    n = metadist.world().world_size
    small = [torch.randn(1024) for _ in range(256)]  # 256 tensors of 4 KiB

    def one_by_one() -> None:
        for t in small:
            comm.all_reduce(t)

    fused = alternate({"one-by-one": one_by_one,
                       "fused": lambda: comm.fused_all_reduce(small)}, reps, inner=3)
    bandwidth = []
    for mib in (0.0625, 0.25, 1, 4, 16, 64):
        x = torch.randn(int(mib * 2**20) // 4)
        inner = max(1, int(8 / mib))  # amortise the barriers on small messages
        t = alternate({"ar": lambda x=x: comm.all_reduce(x)}, reps, inner=inner)["ar"]
        bus = 2 * (n - 1) / n * x.numel() * 4 / t / 1e9
        bandwidth.append((mib, t * 1e3, x.numel() * 4 / t / 1e9, bus))
    prims = []
    for mib in (4, 25):
        full = torch.randn(int(mib * 2**20) // 4 // n * n)
        prims.append((mib, _primitives(full, torch.randn(full.numel() // n), reps)))
    return {"fused": fused, "bandwidth": bandwidth, "prims": prims}


def _tracking_alone(calls: int = 100_000) -> float:
    """Seconds per tracker enter + exit pair: the watchdog's whole hot-path cost."""
    import time

    from metadist.runtime.tracker import TRACKER

    pg = dist.group.WORLD
    start = time.perf_counter()
    for _ in range(calls):
        TRACKER.exit(TRACKER.enter("all_reduce", pg))
    return (time.perf_counter() - start) / calls


def _latency(reps: int) -> tuple[float, list[tuple[str, float, float, float]]]:
    """Per-call seconds of an all-reduce: torch directly, through comm (watchdog tracking),
    and through comm in debug mode (one fingerprint all-gather more per call)."""
    alone = _tracking_alone()
    rows = []
    for nbytes in (4, 4096, 1 << 18, 1 << 22):
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
                       "debug": debug_on}, reps, inner=inner)
        rows.append((f"{nbytes} B" if nbytes < 1024 else f"{nbytes // 1024} KiB",
                     t["torch"], t["comm"], t["debug"]))
    return alone, rows


def _print_latency(alone: float, rows: list[tuple[str, float, float, float]], world: int,
                   reps: int) -> None:
    print(f"## Per-call all-reduce latency on gloo, world size {world} (medians of {reps}, "
          "alternating)\n")
    print(f"watchdog tracking alone (tracker enter + exit): {alone * 1e6:.2f} us per call\n")
    print(table(["payload", "torch.distributed us", "comm us", "comm debug us",
                 "comm vs torch", "debug vs comm"],
                [(size, a * 1e6, b * 1e6, c * 1e6, f"{(b - a) / a:+.1%}", f"{(c - b) / b:+.1%}")
                 for size, a, b, c in rows]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--debug", action="store_true",
                    help="only measure comm's per-call tracking and debug-mode overhead")
    args = ap.parse_args()
    if args.debug:
        alone, rows = metadist.launch(_latency, args.world, args=(args.reps,), threads=1)[0]
        _print_latency(alone, rows, args.world, args.reps)
        return
    out = metadist.launch(_body, args.world, args=(args.reps,), threads=1)[0]
    fused = out["fused"]
    print(f"## Collectives on gloo, world size {args.world} (medians of {args.reps}, "
          "alternating, warm-up discarded)\n")
    print(table(["256 x 4 KiB all-reduce", "ms", "speed-up"], [
        ("one collective per tensor", fused["one-by-one"] * 1e3, 1.0),
        ("fused (one per 25 MiB bucket)", fused["fused"] * 1e3,
         fused["one-by-one"] / fused["fused"]),
    ]))
    print()
    print(table(["all-reduce MiB", "ms", "algbw GB/s", "busbw GB/s"], out["bandwidth"]))
    print()
    rows = []
    for mib, times in out["prims"]:
        for name, t in times.items():
            rows.append((f"{mib} MiB", name, t * 1e3))
    print(table(["full buffer", "primitive", "ms"], rows))


if __name__ == "__main__":
    main()
