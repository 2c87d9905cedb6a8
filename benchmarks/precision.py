"""Precision modes per strategy: step time, per-rank state memory and activation memory.

    python -m benchmarks.precision [--world 2] [--steps 10] [--workloads transformer,mlp]
                                   [--device auto|cpu|cuda] [--json PATH] [--quick]

For each strategy every precision trains its own copy of the model in the same processes,
taking turns step by step (warm-up discarded, medians), Adam. State memory is the bytes of
the unique storages behind parameters, gradients and optimizer state after a step;
activation memory is what the forward leaves allocated for backward (measured outside the
timed steps with ``metadist.testing.bytes_kept_by``). On cuda (NCCL, one GPU per rank) the
activations are the CUDA allocator's count, ``16-mixed`` joins the modes, and under ddp torch
DDP with autocast (bf16, and fp16 with ``torch.amp.GradScaler``) runs beside them: the
anchors of the mixed modes, which are too slow on CPUs to mean anything there.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import metadist
from benchmarks import device
from benchmarks.common import Results, output_args, parse, rotation, run_jobs, timed
from benchmarks.models import workload, zero3_unit_params
from metadist.testing import unique_storage_bytes

PRECISIONS = {  # label: strategy options
    "32-true": {"precision": "32-true"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "bf16-mixed, bf16 reduce": {"precision": "bf16-mixed", "reduce_dtype": "bfloat16"},
    "bf16-true": {"precision": "bf16-true"},
}
CUDA_PRECISIONS = {"16-mixed": {"precision": "16-mixed"}}  # float16 has no fast CPU path
#: torch's own mixed precision under ddp on cuda: label -> autocast dtype (fp16 with a scaler)
TORCH_AMP = {"torch DDP, bf16 autocast": torch.bfloat16,
             "torch DDP, fp16 autocast + GradScaler": torch.float16}


class _TorchAmp:
    """torch DDP with autocast (and GradScaler for float16), stepped as torch's AMP recipe
    writes it: the anchor of metadist's mixed modes."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model = device.ddp(model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.dtype = dtype
        self.scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    def loss(self, loss_fn: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=self.dtype):
            return loss_fn(self.model(x), y)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()


def _state_bytes(model: metadist.DistributedModule, opt: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return (unique_storage_bytes(params) + unique_storage_bytes(p.grad for p in params)
            + unique_storage_bytes(state))


def _body(name: str, strategy: str, steps: int, warmup: int,
          quick: bool = False) -> dict[str, Any]:
    factory, data, loss_fn = workload(name, quick)
    dev = device.here()
    batches = [(x.to(dev), y.to(dev)) for x, y in data(metadist.world().rank)]
    cuda = device.on_cuda()
    runs: dict[str, Any] = {}
    for label, options in {**PRECISIONS, **(CUDA_PRECISIONS if cuda else {})}.items():
        extra: dict[str, Any] = {}
        if strategy == "zero3":
            extra = ({"min_unit_params": zero3_unit_params(quick)} if name == "mlp"
                     else {"wrap_classes": (torch.nn.TransformerEncoderLayer,)})
        s = metadist.strategy(strategy, **options, **extra)
        model = factory()
        wrapped, opt = s.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
        runs[label] = (s, wrapped, opt, [0])
    if cuda and strategy == "ddp":
        for label, dtype in TORCH_AMP.items():
            amp = _TorchAmp(factory().to(dev), dtype)
            runs[label] = (amp, amp.model, amp.opt, [0])

    def forward(label: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s, wrapped, _, _ = runs[label]
        return s.loss(loss_fn, x, y) if isinstance(s, _TorchAmp) else loss_fn(wrapped(x), y)

    def step(label: str) -> None:
        s, _, opt, i = runs[label]
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        s.backward(forward(label, x, y))
        if not isinstance(s, _TorchAmp):  # the scaler stepped it
            opt.step()
        opt.zero_grad(set_to_none=False)

    samples: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + steps):
        for label in rotation(list(runs), i):
            t = timed(lambda label=label: step(label))
            if i >= warmup:
                samples[label].append(t)
    activations = {}
    for label, (s, _, opt, _) in runs.items():
        x, y = batches[0]
        loss, held = device.kept_bytes(lambda label=label, x=x, y=y: forward(label, x, y))
        s.backward(loss)
        opt.zero_grad(set_to_none=False)
        activations[label] = held
    return {"median": {k: statistics.median(v) for k, v in samples.items()},
            "state": {k: _state_bytes(r[1], r[2]) for k, r in runs.items()},
            "activations": activations}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per precision")
    ap.add_argument("--warmup", type=int, default=2, help="steps discarded first")
    ap.add_argument("--workloads", default="transformer", help="comma-separated")
    ap.add_argument("--strategies", default="ddp,zero2,zero3", help="comma-separated")
    device.add_args(ap)
    output_args(ap)
    args = parse(ap, steps=2, warmup=1)
    device.resolve(args)
    with Results("precision", args) as out:  # JSON also of what ran before a failure
        records = []
        for name in args.workloads.split(","):
            out.heading(f"{name}, world size {args.world}, {device.where(args.world)}, Adam "
                        f"(medians of {args.steps}, alternating)")
            strategies = args.strategies.split(",")
            jobs = [(name, strategy, args.steps, args.warmup, args.quick)
                    for strategy in strategies]
            rows = []
            for strategy, res in zip(strategies, run_jobs(_body, jobs, args.world, args.quick),
                                     strict=True):
                base = res["median"]["32-true"]
                for label in res["median"]:
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
