"""Precision modes per strategy: step time, per-rank state memory and activation memory.

    python -m benchmarks.precision [--world 2] [--steps 10] [--workloads transformer,mlp]

For each strategy every precision trains its own copy of the model in the same processes,
taking turns step by step (warm-up discarded, medians), Adam. State memory is the bytes of
the unique storages behind parameters, gradients and optimizer state after a step;
activation memory is what the forward leaves allocated for backward (measured outside the
timed steps with ``metadist.testing.bytes_kept_by``).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import metadist
from benchmarks.common import rotation, table, timed
from benchmarks.models import workload
from metadist.testing import bytes_kept_by, unique_storage_bytes

PRECISIONS = {  # label: strategy options
    "32-true": {"precision": "32-true"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "bf16-mixed, bf16 reduce": {"precision": "bf16-mixed", "reduce_dtype": "bfloat16"},
    "bf16-true": {"precision": "bf16-true"},
}


def _state_bytes(model: metadist.DistributedModule, opt: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return (unique_storage_bytes(params) + unique_storage_bytes(p.grad for p in params)
            + unique_storage_bytes(state))


def _body(name: str, strategy: str, steps: int, warmup: int) -> dict[str, Any]:
    factory, data, loss_fn = workload(name)
    batches = data(metadist.world().rank)
    runs = {}
    for label, options in PRECISIONS.items():
        extra: dict[str, Any] = {}
        if strategy == "zero3":
            extra = ({"min_unit_params": 1_000_000} if name == "mlp"
                     else {"wrap_classes": (torch.nn.TransformerEncoderLayer,)})
        s = metadist.strategy(strategy, **options, **extra)
        model = factory()
        wrapped, opt = s.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
        runs[label] = (s, wrapped, opt, [0])

    def step(label: str) -> None:
        s, wrapped, opt, i = runs[label]
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        s.backward(loss_fn(wrapped(x), y))
        opt.step()
        opt.zero_grad(set_to_none=False)

    samples: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + steps):
        for label in rotation(list(runs), i):
            t = timed(lambda label=label: step(label))
            if i >= warmup:
                samples[label].append(t)
    activations = {}
    for label, (s, wrapped, opt, _) in runs.items():
        x, y = batches[0]
        loss, held = bytes_kept_by(lambda wrapped=wrapped, x=x, y=y: loss_fn(wrapped(x), y))
        s.backward(loss)
        opt.zero_grad(set_to_none=False)
        activations[label] = held
    return {"median": {k: statistics.median(v) for k, v in samples.items()},
            "state": {k: _state_bytes(r[1], r[2]) for k, r in runs.items()},
            "activations": activations}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workloads", default="transformer")
    ap.add_argument("--strategies", default="ddp,zero2,zero3")
    args = ap.parse_args()
    for name in args.workloads.split(","):
        print(f"## {name}, world size {args.world}, gloo, 1 thread per rank, Adam "
              f"(medians of {args.steps}, alternating)\n")
        rows = []
        for strategy in args.strategies.split(","):
            res = metadist.launch(_body, args.world, args=(name, strategy, args.steps,
                                                           args.warmup),
                                  threads=1, timeout=3000)[0]
            base = res["median"]["32-true"]
            for label in PRECISIONS:
                rows.append((strategy, label, res["median"][label] * 1e3,
                             res["median"][label] / base, res["state"][label] / 2**20,
                             res["activations"][label] / 2**20))
        print(table(["strategy", "precision", "ms / step", "/ 32-true", "state MiB (P+G+O)",
                     "activations MiB"], rows))
        print()


if __name__ == "__main__":
    main()
