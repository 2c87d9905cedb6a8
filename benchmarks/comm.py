"""Collectives on gloo: fused vs one-by-one small all-reduces, bandwidth by message size, and
the backend-aware all_gather / reduce_scatter against torch's native ones.

    python -m benchmarks.comm [--world 2] [--reps 10]
"""

from __future__ import annotations

import argparse

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
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
