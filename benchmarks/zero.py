"""metadist zero1/zero2/zero3 vs torch ZeroRedundancyOptimizer and FSDP2 ``fully_shard``
(and FairScale OSS + ShardedDDP when it is installed in the benchmark environment).

    python -m benchmarks.zero [--world 2] [--steps 12] [--workloads mlp,transformer]
                              [--device auto|cpu|cuda] [--json PATH] [--quick]

Every configuration trains its own copy of the model in the same processes, taking turns
step by step (warm-up discarded, medians), Adam, batch 32 per rank (16 x 64 tokens for the
transformer). Per-rank memory is the bytes of the unique storages behind parameters,
gradients and optimizer state after a step, next to the ZeRO formulas; collectives and bytes
of one more (untimed) step of each metadist strategy, next to the ring limit. On cuda (NCCL,
one GPU per rank) also each configuration's peak during one step above what it held before
(``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import metadist
from benchmarks import device
from benchmarks.common import (
    Results,
    alternate,
    output_args,
    parse,
    run_jobs,
    use_peers,
)
from benchmarks.models import param_count, workload, zero3_unit_params
from metadist.comm import stats
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


def _configs(name: str, kinds: list[str], quick: bool) -> dict[str, Config]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    factory, data, loss_fn = workload(name, quick)
    dev = device.here()
    batches = [(x.to(dev), y.to(dev)) for x, y in data(metadist.world().rank)]
    unit_class = nn.TransformerEncoderLayer
    out: dict[str, Config] = {}
    for kind in kinds:
        model = factory().to(dev)  # metadist's strategies would move it; torch's do not
        match kind:
            case "no-comm bound":
                opt = _adam(model.parameters())
                out[kind] = Config(model, opt, batches, loss_fn, lambda t: t.backward(),
                                   model.parameters)
            case "torch ZeRO (DDP + ZeroRedundancyOptimizer)":
                ddp = device.ddp(model)
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
                if kind.endswith(OVERLAP):
                    options["overlap_param_gather"] = True
                if strategy_name == "zero3":
                    options = ({"min_unit_params": zero3_unit_params(quick)} if name == "mlp"
                               else {"wrap_classes": (unit_class,)})
                s = metadist.strategy(strategy_name, **options)
                wrapped, opt = s.setup(model, _adam(model.parameters()))
                out[kind] = Config(wrapped, opt, batches, loss_fn, s.backward,
                                   wrapped.parameters)
    return out


def step_traffic(config: Config) -> dict[str, Any]:
    """Collectives and bytes of one step (outside the timed ones: counting costs a little;
    without the timing barriers, which are not the strategy's)."""
    with stats.counting() as counted:
        config.step()
    return {"calls": counted.calls, "payload_bytes": counted.bytes,
            "wire_bytes": counted.wire_bytes, "ops": {
                op: {"calls": s.calls, "payload_bytes": s.bytes, "wire_bytes": s.wire_bytes}
                for op, s in counted.ops.items()}}


def _body(name: str, kinds: list[str], steps: int, warmup: int,
          quick: bool = False) -> dict[str, Any]:
    configs = _configs(name, kinds, quick)
    median = alternate({k: c.step for k, c in configs.items()}, reps=steps, warmup=warmup)
    traffic = {k: step_traffic(c) for k, c in configs.items() if k.startswith("metadist")}
    peaks = {k: device.step_peak(c.step) for k, c in configs.items()}
    return {"median": median,
            "memory": {k: c.memory() for k, c in configs.items()}, "traffic": traffic,
            "params": param_count(workload(name, quick)[0]()),
            **({"cuda_peak": peaks} if None not in peaks.values() else {})}


#: zero1/zero2 refresh parameters inside step() by default; this suffix is the opt-in
#: overlapped refresh, measured beside it (what the default costs).
OVERLAP = " overlap_param_gather"
KINDS = ["no-comm bound", "torch ZeRO (DDP + ZeroRedundancyOptimizer)", "torch FSDP2 fully_shard",
         "FairScale OSS + ShardedDDP", "metadist zero1", "metadist zero1" + OVERLAP,
         "metadist zero2", "metadist zero2" + OVERLAP, "metadist zero3"]


ANCHORS = ["torch ZeRO (DDP + ZeroRedundancyOptimizer)", "torch FSDP2 fully_shard",
           "FairScale OSS + ShardedDDP", "no-comm bound", "metadist zero1" + OVERLAP,
           "metadist zero2" + OVERLAP]


def zero_formulas(params: int, n: int) -> dict[str, float]:
    """Per-rank bytes of P+G+O under each ZeRO stage (Adam: O = 2P, all float32)."""
    p_bytes = params * 4
    stages = {"metadist zero1": p_bytes * (2 + 2 / n), "metadist zero2": p_bytes * (1 + 3 / n),
              "metadist zero3": p_bytes * 4 / n}
    return {**stages, **{k + OVERLAP: stages[k] for k in ("metadist zero1", "metadist zero2")}}


def against_ring_limit(res: dict[str, Any], kind: str, n: int) -> dict[str, Any]:
    """``kind``'s measured traffic next to the ring limit of its strategy."""
    limit = ring_limit(kind, res["params"], n)
    return {**res["traffic"][kind], "ring_limit_bytes": limit,
            "wire_over_limit": res["traffic"][kind]["wire_bytes"] / limit}


def ring_limit(kind: str, params: int, n: int) -> float:
    """Bytes one rank must send per step: 2P(N-1)/N, 3P(N-1)/N for zero3 (params gathered
    for the forward and again for the backward)."""
    return (3 if kind == "metadist zero3" else 2) * params * 4 * (n - 1) / n


def _data(res: dict[str, Any], n: int) -> dict[str, Any]:
    """One workload's structured results: per configuration its role, ms, memory against the
    formula and (ours) traffic against the ring limit; every ratio of the table."""
    med, formulas = res["median"], zero_formulas(res["params"], n)
    configs: dict[str, Any] = {}
    for kind, seconds in med.items():
        p, g, o = res["memory"][kind]
        role = "bound" if kind == "no-comm bound" else (
            "metadist" if kind.startswith("metadist") else "anchor")
        entry: dict[str, Any] = {"role": role, "ms": seconds * 1e3, "memory": {
            "params": p, "grads": g, "optim": o, "total": p + g + o}}
        if kind in formulas:
            entry["zero_formula_bytes"] = formulas[kind]
            entry["total_over_formula"] = (p + g + o) / formulas[kind]
        if kind in res["traffic"]:
            entry["traffic"] = against_ring_limit(res, kind, n)
        if "cuda_peak" in res:
            entry["cuda_step_peak_bytes"] = res["cuda_peak"][kind]
        configs[kind] = entry
    ratios = [{"config": kind, "reference": ref, "ratio": med[kind] / med[ref]}
              for kind in med for ref in ANCHORS if ref in med and ref != kind]
    return {"params": res["params"], "configs": configs, "ratios": ratios}


def _report(out: Results, name: str, res: dict[str, Any], kinds: list[str], n: int,
            steps: int) -> None:
    med, formulas = res["median"], zero_formulas(res["params"], n)
    out.heading(f"{name} ({res['params'] / 1e6:.1f}M params), world size {n}, "
                f"{device.where(n)}, Adam (medians of {steps}, alternating)")
    rows = []
    zro = med.get("torch ZeRO (DDP + ZeroRedundancyOptimizer)", float("nan"))
    fsdp2 = med.get("torch FSDP2 fully_shard", float("nan"))
    for kind in kinds:
        p, g, o = res["memory"][kind]
        formula = formulas.get(kind)
        rows.append((kind, med[kind] * 1e3, med[kind] / zro, med[kind] / fsdp2,
                     p / 2**20, g / 2**20, o / 2**20, (p + g + o) / 2**20,
                     f"{(p + g + o) / formula:.3f}" if formula else "-"))
    out.table(["configuration", "ms / step", "/ torch ZeRO", "/ FSDP2", "params MiB",
               "grads MiB", "optim MiB", "total MiB", "total / ZeRO formula"], rows,
              key=f"{name} step time and memory")
    if "cuda_peak" in res:
        out.table(["configuration", "CUDA step peak above resident MiB"],
                  [(k, res["cuda_peak"][k] / 2**20) for k in kinds], key=f"{name} cuda peak")
    rows = []
    for kind, t in res["traffic"].items():
        limit = ring_limit(kind, res["params"], n)
        rows.append((kind, t["calls"], t["payload_bytes"] / 2**20, t["wire_bytes"] / 2**20,
                     limit / 2**20, t["wire_bytes"] / limit))
    if rows:
        out.table(["configuration", "collectives / step", "payload MiB", "wire MiB (ring model)",
                   "ring limit MiB (2P, zero3 3P, x (N-1)/N)", "wire / limit"], rows,
                  key=f"{name} traffic")


def main() -> None:
    peers = use_peers()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="steps discarded first")
    ap.add_argument("--workloads", default="mlp,transformer", help="comma-separated")
    ap.add_argument("--only", default="", help="comma-separated subset of the configurations")
    device.add_args(ap)
    output_args(ap)
    args = parse(ap, steps=2, warmup=1)
    device.resolve(args)
    with Results("zero", args) as out:  # JSON also of what ran before a failure
        kinds = [k for k in KINDS if not args.only or k in args.only.split(",")]
        try:
            import fairscale  # noqa: F401
        except ImportError:
            kinds = [k for k in kinds if k != "FairScale OSS + ShardedDDP"]
            where = "not in .bench/" if peers else ".bench/ does not exist"
            out.skip("FairScale OSS + ShardedDDP", f"FairScale is not installed ({where}; `make "
                     "bench` installs it there)")
        n = args.world
        names = args.workloads.split(",")
        jobs = [(name, kinds, args.steps, args.warmup, args.quick) for name in names]
        workloads: dict[str, Any] = {}
        for name, res in zip(names, run_jobs(_body, jobs, n, args.quick), strict=True):
            _report(out, name, res, kinds, n, args.steps)
            workloads[name] = _data(res, n)
        out.data = {"world": n, "workloads": workloads}


if __name__ == "__main__":
    main()
