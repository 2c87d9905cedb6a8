"""MAML tasks per second: metadist.mapreduce (spmd and rpc engines) vs TorchOpt 0.7.3's own
torchopt.distributed, on the same second-order MAML problem, world size 2.

    python -m benchmarks.mapreduce [--reps 10] [--meta-batch 25] [--inner-steps 1]
                                   [--inner functional|metasgd] [--torch-rpc-defaults]
                                   [--json PATH] [--quick]

Sinusoid regression as in the MAML paper: a 1-40-40-1 MLP (tanh, so second-order terms are
not zero), 10 support and 10 query points per task, ``meta-batch`` tasks per meta-step,
``inner-steps`` differentiable SGD steps per task, Adam on the meta-gradient. The task
function is the same for every configuration (only the parallel layer differs): by default a
functional inner loop (``torch.func.functional_call`` + ``autograd.grad(create_graph=True)``);
``--inner metasgd`` uses ``module_clone(by="copy")`` + ``MetaSGD`` instead, whose module
copy costs more than the task itself at this size. One task per part
(``dim_partitioner(0, exclusive=True, keepdim=False)`` + ``mean_reducer``). Configurations
take turns in the same processes (warm-up discarded, medians). Under rpc (both libraries)
rank 0 drives and rank 1 serves; under spmd both ranks drive; "one process" runs every task
on rank 0 alone. RPC starts once for both libraries, with metadist's options (TCP only) or,
with ``--torch-rpc-defaults``, torch's (adds a shared-memory transport: faster calls, a
busy-polling core per process). The TorchOpt row needs it in ``.bench/`` (``make bench``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import metadist
import metadist.mapreduce as todist
from benchmarks.common import Results, alternate, output_args, parse, use_peers
from metadist.meta import MetaSGD, module_clone

K, INNER_LR = 10, 0.01
INNER = {"steps": 1, "kind": "functional"}  # set from the command line in every rank


def task_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The work of one task, shared by every configuration."""
    if INNER["kind"] == "metasgd":
        learner = module_clone(net, by="copy")
        inner = MetaSGD(learner, lr=INNER_LR)
        for _ in range(int(INNER["steps"])):
            inner.step(nn.functional.mse_loss(learner(x[:K]), y[:K]))
        return nn.functional.mse_loss(learner(x[K:]), y[K:])
    params = dict(net.named_parameters())
    for _ in range(int(INNER["steps"])):
        loss = nn.functional.mse_loss(functional_call(net, params, (x[:K],)), y[:K])
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {n: p - INNER_LR * g for (n, p), g in zip(params.items(), grads, strict=True)}
    return nn.functional.mse_loss(functional_call(net, params, (x[K:],)), y[K:])


@todist.parallelize(partitioner=todist.dim_partitioner(0, exclusive=True, keepdim=False),
                    reducer=todist.mean_reducer)
def metadist_inner_loop(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return task_loss(net, x, y)


def torchopt_inner_loop(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return task_loss(net, x, y)  # parallelized by TorchOpt at start-up, on every rank


def _tasks(step: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    amplitude = 0.1 + 4.9 * torch.rand(count, 1, 1, generator=g)
    phase = math.pi * torch.rand(count, 1, 1, generator=g)
    x = torch.rand(count, 2 * K, 1, generator=g) * 10 - 5
    return x, amplitude * torch.sin(x + phase)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                         nn.Linear(40, 1))


class Trainer:
    """One configuration's network, meta-optimiser and step counter."""

    def __init__(self, meta_batch: int, step: Callable[[nn.Module, torch.Tensor, torch.Tensor],
                                                       None], drives: bool) -> None:
        self.net, self.meta_batch, self.run, self.drives = _net(), meta_batch, step, drives
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        self.steps = 0

    def step(self) -> None:
        if not self.drives:
            return  # serves rpc calls in the background, or idles
        x, y = _tasks(self.steps, self.meta_batch)
        self.steps += 1
        self.opt.zero_grad()
        self.run(self.net, x, y)
        self.opt.step()


def _one_process(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.stack([task_loss(net, x[i], y[i]) for i in range(len(x))]).mean().backward()


def _metadist(engine: str) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], None]:
    def run(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        todist.init(engine)  # switches the engine; RPC stays up
        with todist.autograd.context() as ctx:
            todist.autograd.backward(ctx, metadist_inner_loop(net, x, y))

    return run


def _torchopt() -> Callable[[nn.Module, torch.Tensor, torch.Tensor], None]:
    import torchopt
    import torchopt.distributed as to_dist

    parallel = to_dist.parallelize(
        partitioner=to_dist.dim_partitioner(0, exclusive=True, keepdim=False),
        reducer=to_dist.mean_reducer)(torchopt_inner_loop)

    def run(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        sent = torchopt.module_clone(net, by="copy")  # TorchOpt's way to keep the graph
        with to_dist.autograd.context() as ctx:
            to_dist.autograd.backward(ctx, parallel(sent, x, y))

    return run


def _body(names: list[str], reps: int, warmup: int, meta_batch: int, inner_steps: int,
          inner: str, torch_rpc_defaults: bool) -> dict[str, Any]:
    INNER.update(steps=inner_steps, kind=inner)
    # RPC up once, for both libraries (worker names worker<rank>). metadist's default options
    # use TCP only; torch's defaults add a shared-memory transport that busy-polls a core.
    from torch.distributed import rpc

    todist.init("rpc", rpc_backend_options=(
        rpc.TensorPipeRpcBackendOptions() if torch_rpc_defaults else None))
    rank0 = metadist.world().rank == 0
    trainers: dict[str, Trainer] = {}
    for name in names:
        match name:
            case "one process":
                trainers[name] = Trainer(meta_batch, _one_process, rank0)
            case "metadist spmd":
                trainers[name] = Trainer(meta_batch, _metadist("spmd"), True)
            case "metadist rpc":
                trainers[name] = Trainer(meta_batch, _metadist("rpc"), rank0)
            case "TorchOpt 0.7.3 rpc":
                trainers[name] = Trainer(meta_batch, _torchopt(), rank0)
            case _:
                raise ValueError(f"configuration {name!r} is not known; choose from: "
                                 f"{', '.join(CONFIGS)}")
    medians = alternate({n: t.step for n, t in trainers.items()}, reps, warmup)
    params = {n: [p.detach() for p in t.net.parameters()] for n, t in trainers.items()}
    todist.shutdown()
    return {"median": medians, "params": params if rank0 else None}


CONFIGS = ["one process", "metadist spmd", "metadist rpc", "TorchOpt 0.7.3 rpc"]


def main() -> None:
    peers = use_peers()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10, help="timed meta-steps (medians)")
    ap.add_argument("--warmup", type=int, default=2, help="meta-steps discarded first")
    ap.add_argument("--meta-batch", type=int, default=25, help="tasks per meta-step")
    ap.add_argument("--inner-steps", type=int, default=1, help="inner SGD steps per task")
    ap.add_argument("--inner", choices=["functional", "metasgd"], default="functional")
    ap.add_argument("--torch-rpc-defaults", action="store_true",
                    help="start RPC with torch's default TensorPipe options (as TorchOpt's "
                         "auto_init_rpc does) instead of metadist's")
    output_args(ap)
    args = parse(ap, reps=2, warmup=1, meta_batch=4)
    with Results("mapreduce", args) as out:  # JSON also of what ran before a failure
        names = list(CONFIGS)
        try:
            import torchopt.distributed  # noqa: F401
        except ImportError:
            names.remove("TorchOpt 0.7.3 rpc")
            where = "not in .bench/" if peers else ".bench/ does not exist"
            out.skip("TorchOpt 0.7.3 rpc", f"TorchOpt is not installed ({where}; `make bench` or "
                     "`python -m pip install --no-deps --target .bench torchopt==0.7.3 optree "
                     "graphviz`)")
        res = metadist.launch(_body, 2, args=(names, args.reps, args.warmup, args.meta_batch,
                                              args.inner_steps, args.inner,
                                              args.torch_rpc_defaults), threads=1,
                              timeout=3000)[0]
        med, params = res["median"], res["params"]
        base = med.get("TorchOpt 0.7.3 rpc", float("nan"))
        reference = params["one process"]
        out.heading(f"Second-order MAML, {args.meta_batch} tasks x {args.inner_steps} inner steps "
                    f"({args.inner} inner loop) per meta-step, world size 2, gloo, 1 thread per "
                    f"rank, RPC with {'torch' if args.torch_rpc_defaults else 'metadist'}'s "
                    f"default options (medians of {args.reps}, alternating)")
        rows, records = [], []
        for name in names:
            drift = max((p - q).abs().max().item()
                        for p, q in zip(params[name], reference, strict=True))
            rows.append((name, med[name] * 1e3, args.meta_batch / med[name],
                         base / med[name], f"{drift:.1e}"))
            records.append({"configuration": name, "ms": med[name] * 1e3,
                            "tasks_per_s": args.meta_batch / med[name],
                            "x_torchopt": base / med[name], "max_param_diff": drift})
        out.table(["configuration", "ms / meta-step", "tasks / s", "x TorchOpt throughput",
                   "max |param - one process| after the run"], rows, key="mapreduce")
        out.data = {"world": 2, "rows": records}


if __name__ == "__main__":
    main()
