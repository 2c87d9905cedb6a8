"""Precision modes per strategy: step time, per-rank state memory and activation memory.

    python -m benchmarks.precision [--world 2] [--steps 10] [--workloads transformer,mlp]
                                   [--json PATH] [--quick]

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
from benchmarks.common import Results, output_args, parse, rotation, run_jobs, timed
from benchmarks.models import workload, zero3_unit_params
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


def _body(name: str, strategy: str, steps: int, warmup: int,
          quick: bool = False) -> dict[str, Any]:
    factory, data, loss_fn = workload(name, quick)
    batches = data(metadist.world().rank)
    runs = {}
    for label, options in PRECISIONS.items():
        extra: dict[str, Any] = {}
        if strategy == "zero3":
            extra = ({"min_unit_params": zero3_unit_params(quick)} if name == "mlp"
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
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per precision")
    ap.add_argument("--warmup", type=int, default=2, help="steps discarded first")
    ap.add_argument("--workloads", default="transformer", help="comma-separated")
    ap.add_argument("--strategies", default="ddp,zero2,zero3", help="comma-separated")
    output_args(ap)
    args = parse(ap, steps=2, warmup=1)
    with Results("precision", args) as out:  # JSON also of what ran before a failure
        records = []
        for name in args.workloads.split(","):
            out.heading(f"{name}, world size {args.world}, gloo, 1 thread per rank, Adam "
                        f"(medians of {args.steps}, alternating)")
            strategies = args.strategies.split(",")
            jobs = [(name, strategy, args.steps, args.warmup, args.quick)
                    for strategy in strategies]
            rows = []
            for strategy, res in zip(strategies, run_jobs(_body, jobs, args.world, args.quick),
                                     strict=True):
                base = res["median"]["32-true"]
                for label in PRECISIONS:
                    rows.append((strategy, label, res["median"][label] * 1e3,
                                 res["median"][label] / base, res["state"][label] / 2**20,
                                 res["activations"][label] / 2**20))
                    records.append({"workload": name, "strategy": strategy, "precision": label,
                                    "ms": res["median"][label] * 1e3,
                                    "over_32_true": res["median"][label] / base,
                                    "state_bytes": res["state"][label],
                                    "activation_bytes": res["activations"][label]})
            out.table(["strategy", "precision", "ms / step", "/ 32-true", "state MiB (P+G+O)",
                       "activations MiB"], rows, key=f"{name} precision")
        out.data = {"world": args.world, "rows": records}


if __name__ == "__main__":
    main()
