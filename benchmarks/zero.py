"""metadist zero1/zero2/zero3 vs torch ZeroRedundancyOptimizer and FSDP2 ``fully_shard``
(and FairScale OSS + ShardedDDP when it is installed in the benchmark environment).

    python -m benchmarks.zero [--world 2] [--steps 12] [--workloads mlp,transformer]

Every configuration trains its own copy of the model in the same processes, taking turns
step by step (warm-up discarded, medians), Adam, batch 32 per rank (16 x 64 tokens for the
transformer). Per-rank memory is the bytes of the unique storages behind parameters,
gradients and optimizer state after a step, next to the ZeRO formulas.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import metadist
from benchmarks.common import rotation, table, timed
from benchmarks.models import param_count, workload
from metadist.testing import unique_storage_bytes


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(opt, "optim", None) or opt  # ZeroRedundancyOptimizer, FairScale OSS
    return [v for st in inner.state.values() for v in st.values()
            if torch.is_tensor(v) and v.dim() > 0]


class Config:
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, batches: list,
                 loss_fn: Callable, backward: Callable[[torch.Tensor], None],  # type: ignore[type-arg]
                 params: Callable[[], list[torch.Tensor]]) -> None:
        self.model, self.opt, self.batches = model, opt, batches
        self.loss_fn, self.backward, self.params = loss_fn, backward, params
        self.i = 0

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.backward(self.loss_fn(self.model(x), y))
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def memory(self) -> tuple[int, int, int]:
        ps = list(self.params())
        grads = [p.grad for p in ps]
        return (unique_storage_bytes(ps), unique_storage_bytes(grads),
                unique_storage_bytes(_state(self.opt)))


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def _configs(name: str, kinds: list[str]) -> dict[str, Config]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    factory, data, loss_fn = workload(name)
    batches = data(metadist.world().rank)
    unit_class = nn.TransformerEncoderLayer
    out: dict[str, Config] = {}
    for kind in kinds:
        model = factory()
        match kind:
            case "no-comm bound":
                opt = _adam(model.parameters())
                out[kind] = Config(model, opt, batches, loss_fn, lambda t: t.backward(),
                                   model.parameters)
            case "torch ZeRO (DDP + ZeroRedundancyOptimizer)":
                ddp = DistributedDataParallel(model)
                opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                              lr=1e-4)
                out[kind] = Config(ddp, opt, batches, loss_fn, lambda t: t.backward(),
                                   ddp.parameters)
            case "torch FSDP2 fully_shard":
                from torch.distributed.fsdp import fully_shard

                for m in model.modules():
                    if isinstance(m, nn.Linear if name == "mlp" else unit_class):
                        fully_shard(m)
                fully_shard(model)
                opt = _adam(model.parameters())
                out[kind] = Config(model, opt, batches, loss_fn, lambda t: t.backward(),
                                   model.parameters)
            case "FairScale OSS + ShardedDDP":
                from fairscale.nn.data_parallel import ShardedDataParallel
                from fairscale.optim.oss import OSS

                opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
                sdp = ShardedDataParallel(model, opt)
                out[kind] = Config(sdp, opt, batches, loss_fn, lambda t: t.backward(),
                                   sdp.parameters)
            case _:
                strategy_name = kind.split()[1]
                options: dict[str, Any] = {}
                if strategy_name == "zero3":
                    options = ({"min_unit_params": 1_000_000} if name == "mlp"
                               else {"wrap_classes": (unit_class,)})
                s = metadist.strategy(strategy_name, **options)
                wrapped, opt = s.setup(model, _adam(model.parameters()))
                out[kind] = Config(wrapped, opt, batches, loss_fn, s.backward,
                                   wrapped.parameters)
    return out


def _body(name: str, kinds: list[str], steps: int, warmup: int) -> dict[str, Any]:
    configs = _configs(name, kinds)
    samples: dict[str, list[float]] = {k: [] for k in configs}
    for i in range(warmup + steps):
        for key in rotation(list(configs), i):
            t = timed(configs[key].step)
            if i >= warmup:
                samples[key].append(t)
    return {"median": {k: statistics.median(v) for k, v in samples.items()},
            "memory": {k: c.memory() for k, c in configs.items()},
            "params": param_count(workload(name)[0]())}


KINDS = ["no-comm bound", "torch ZeRO (DDP + ZeroRedundancyOptimizer)", "torch FSDP2 fully_shard",
         "FairScale OSS + ShardedDDP", "metadist zero1", "metadist zero2", "metadist zero3"]


def main() -> None:
    bench_pkgs = Path(__file__).resolve().parent.parent / ".bench"  # `make bench` installs here
    if bench_pkgs.is_dir():
        sys.path.append(str(bench_pkgs))  # after ours (its wheel ships a `benchmarks` too)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--workloads", default="mlp,transformer")
    ap.add_argument("--only", default="", help="comma-separated subset of the configurations")
    args = ap.parse_args()
    kinds = [k for k in KINDS if not args.only or k in args.only.split(",")]
    try:
        import fairscale  # noqa: F401
    except ImportError:
        kinds = [k for k in kinds if k != "FairScale OSS + ShardedDDP"]
        print("(FairScale not installed here: its row is skipped; see the README for the "
              "benchmark environment)\n")
    n = args.world
    for name in args.workloads.split(","):
        res = metadist.launch(_body, n, args=(name, kinds, args.steps, args.warmup), threads=1,
                              timeout=3000)[0]
        med = res["median"]
        p_bytes = res["params"] * 4
        formulas = {"metadist zero1": p_bytes * (2 + 2 / n),
                    "metadist zero2": p_bytes * (1 + 3 / n), "metadist zero3": p_bytes * 4 / n}
        print(f"## {name} ({res['params'] / 1e6:.1f}M params), world size {n}, gloo, 1 thread "
              f"per rank, Adam (medians of {args.steps}, alternating)\n")
        rows = []
        zro = med.get("torch ZeRO (DDP + ZeroRedundancyOptimizer)", float("nan"))
        fsdp2 = med.get("torch FSDP2 fully_shard", float("nan"))
        for kind in kinds:
            p, g, o = res["memory"][kind]
            formula = formulas.get(kind)
            rows.append((kind, med[kind] * 1e3, med[kind] / zro, med[kind] / fsdp2,
                         p / 2**20, g / 2**20, o / 2**20, (p + g + o) / 2**20,
                         f"{(p + g + o) / formula:.3f}" if formula else "-"))
        print(table(["configuration", "ms / step", "/ torch ZeRO", "/ FSDP2", "params MiB",
                     "grads MiB", "optim MiB", "total MiB", "total / ZeRO formula"], rows))
        print()


if __name__ == "__main__":
    main()
