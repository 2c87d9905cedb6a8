"""Distributed second-order MAML with task-parallel inner loops (metadist.mapreduce).

    metadist run --nproc 2 examples/maml_mapreduce.py                 # spmd engine
    metadist run --nproc 2 examples/maml_mapreduce.py --backend rpc   # torch RPC, rank 0 drives

Each meta-step draws a batch of sinusoid regression tasks, shape (tasks, 2k, 1).
``dim_partitioner(0, exclusive=True, keepdim=False)`` makes one part per task, dealt
round-robin over the ranks; each part adapts its own differentiable copy of the network with
``MetaSGD`` and returns its query loss; ``mean_reducer`` averages them. The outer backward
runs through every inner step. Under spmd every rank runs this loop and holds the same
parameters afterwards; under rpc rank 0 runs it and the other ranks serve tasks. Both give
the parameters single-process MAML on the whole task batch would.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import metadist.mapreduce as todist
from metadist.meta import MetaSGD, module_clone


def sinusoid_tasks(step: int, count: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` tasks y = a sin(x + b); the first k points of each are its support set."""
    g = torch.Generator().manual_seed(step)
    amplitude = 0.1 + 4.9 * torch.rand(count, 1, 1, generator=g)
    phase = math.pi * torch.rand(count, 1, 1, generator=g)
    x = torch.rand(count, 2 * k, 1, generator=g) * 10 - 5
    return x, amplitude * torch.sin(x + phase)


@todist.parallelize(partitioner=todist.dim_partitioner(0, exclusive=True, keepdim=False),
                    reducer=todist.mean_reducer)
def inner_loop(net: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, inner_steps: int,
               inner_lr: float) -> torch.Tensor:
    """One task (x, y: (2k, 1)): adapt on the support set, return the query loss."""
    learner = module_clone(net, by="copy")  # differentiable: gradients reach net
    optimizer = MetaSGD(learner, lr=inner_lr)
    for _ in range(inner_steps):
        optimizer.step(nn.functional.mse_loss(learner(x[:k]), y[:k]))
    return nn.functional.mse_loss(learner(x[k:]), y[k:])


def build_net() -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return nn.Sequential(nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                         nn.Linear(40, 1))


@todist.rank_zero_only
def report(text: str) -> None:
    print(text, flush=True)


def train(args: argparse.Namespace) -> None:
    if not todist.is_driver():
        return  # rpc: this rank serves the tasks rank 0 sends until rank 0 is done
    net = build_net()
    meta_optimizer = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    start, recent = time.perf_counter(), []
    for step in range(args.steps):
        x, y = sinusoid_tasks(step, args.meta_batch, args.k)
        meta_optimizer.zero_grad()
        with todist.autograd.context() as ctx:
            meta_loss = inner_loop(net, x, y, args.k, args.inner_steps, args.inner_lr)
            todist.autograd.backward(ctx, meta_loss)
        meta_optimizer.step()
        recent = [*recent[-9:], meta_loss.item()]
        if step % args.log_every == 0:
            report(f"step {step:4d}  meta-loss {meta_loss.item():.4f}")
    elapsed = time.perf_counter() - start
    report(f"engine {todist.engine()}  ranks {todist.get_world_size()}  "
           f"final meta-loss {sum(recent) / len(recent):.4f} (mean of the last {len(recent)} "
           f"steps)  {args.steps * args.meta_batch / elapsed:.0f} tasks/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=todist.ENGINES, default="spmd",
                        help="map-reduce engine (default: spmd)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--meta-batch", type=int, default=16, help="tasks per meta-step")
    parser.add_argument("--k", type=int, default=10, help="support (= query) points per task")
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--inner-lr", type=float, default=0.01)
    parser.add_argument("--meta-lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()
    todist.auto_init_rpc(engine=args.backend)(train)(args)


if __name__ == "__main__":
    main()
