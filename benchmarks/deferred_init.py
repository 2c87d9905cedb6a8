"""Deferred initialisation under zero3: per-rank peak memory and time of build + setup.

    python -m benchmarks.deferred_init [--worlds 2,4] [--layers 8] [--width 256]
                                       [--reps 3] [--json PATH] [--quick]

HF transformers' GPT-2 (from a config, random init), each GPT2Block a zero3 unit. Eager: the
model is built whole on every rank, then set up. Deferred: built under
``metadist.deferred_init()`` (meta tensors plus a log of their initialisation), and setup
materialises one unit at a time, each rank keeping its shards. The peak is the most bytes of
tensor storage alive at once during build + setup (every operator's allocations, counted at
every operator; immune to the allocator's caching), against the full model and the ZeRO-3
target: the model / world (this rank's shards) + the unit being materialised + its gather
buffer (allocated and freed at once when the unit is set up, as FSDP2 does: on the CPU its
pages are never touched, on CUDA the next unit reuses the cached block). Times: build +
setup, the two alternating, warm-up discarded, medians. The initial parameters of the two
are checked equal.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from typing import Any

import torch

import metadist
from benchmarks.common import Results, output_args, parse, rotation
from metadist.testing import peak_bytes_of, unique_storage_bytes


def _gpt2(layers: int, width: int) -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                        vocab_size=8192, n_positions=256)
    return (lambda: GPT2LMHeadModel(config)), GPT2Block


def _build_and_setup(layers: int, width: int, deferred: bool) -> Any:
    build, block = _gpt2(layers, width)
    torch.manual_seed(0)
    if deferred:
        with metadist.deferred_init():
            model = build()
    else:
        model = build()
    strategy = metadist.strategy("zero3", wrap_classes=(block,))
    return strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))[0]


def _body(layers: int, width: int, reps: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    digests = {}
    for deferred in (False, True):
        model, peak = peak_bytes_of(lambda d=deferred: _build_and_setup(layers, width, d))
        state = model.state_dict()
        digest = hashlib.sha256()
        for value in state.values():
            digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
        digests[deferred] = digest.hexdigest()
        out["deferred" if deferred else "eager"] = {"peak": peak}
        del model, state
    plain = _gpt2(layers, width)[0]()  # tied weights counted once
    out["full_bytes"] = unique_storage_bytes([*plain.parameters(), *plain.buffers()])
    blocks = [unique_storage_bytes(block.parameters()) for block in plain.transformer.h]
    # The largest unit: a block, or the root (embeddings, head, final norm: the rest).
    out["unit_bytes"] = max(*blocks, out["full_bytes"] - sum(blocks))
    del plain
    out["equal_init"] = digests[False] == digests[True]
    samples: dict[str, list[float]] = {"eager": [], "deferred": []}
    for i in range(warmup + reps):
        for name in rotation(["eager", "deferred"], i):
            metadist.barrier()
            start = time.perf_counter()
            _build_and_setup(layers, width, name == "deferred")
            metadist.barrier()
            if i >= warmup:
                samples[name].append(time.perf_counter() - start)
    for name, ts in samples.items():
        out[name]["seconds"] = statistics.median(ts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    output_args(ap)
    args = parse(ap, worlds="2", layers=2, width=64, reps=1, warmup=0)
    with Results("deferred_init", args) as results:
        results.heading(f"Deferred init: GPT-2 ({args.layers} blocks, width {args.width}) "
                        "under zero3, per-rank peak during build + setup")
        rows, data = [], []
        for world in (int(w) for w in args.worlds.split(",")):
            r = metadist.launch(_body, world, args=(args.layers, args.width, args.reps,
                                                    args.warmup), threads=1, timeout=3000)[0]
            full, unit = r["full_bytes"], r["unit_bytes"]
            target = full / world + 2 * unit
            mib = 1 << 20
            rows.append([world, f"{full / mib:.1f}", f"{r['eager']['peak'] / mib:.1f}",
                         f"{r['deferred']['peak'] / mib:.1f}", f"{target / mib:.1f}",
                         f"{r['deferred']['peak'] / full:.2f}",
                         f"{r['eager']['seconds']:.2f}", f"{r['deferred']['seconds']:.2f}",
                         "yes" if r["equal_init"] else "NO"])
            data.append({"world": world, **r, "target_bytes": target})
        results.table(["world", "model MiB", "eager peak MiB", "deferred peak MiB",
                       "target MiB (model/world + 2 units)", "deferred / model",
                       "eager s", "deferred s", "same init"], rows, key="peak")
        results.data["worlds"] = data


if __name__ == "__main__":
    main()
