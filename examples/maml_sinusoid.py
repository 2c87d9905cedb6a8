"""Second-order MAML on sinusoid regression, data parallel over tasks.

    metadist run --nproc 2 examples/maml_sinusoid.py --strategy ddp

Each rank adapts to its share of the meta-batch with `torch.autograd.grad(create_graph=True)`
(inner-loop gradients stay local); the outer backward produces the meta-gradient, which the
strategy averages once. The result equals single-process MAML on the whole meta-batch.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import metadist


def tasks(step: int, count: int, k: int = 10) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(count):
        amp, phase = 0.1 + 4.9 * torch.rand(1, generator=g), math.pi * torch.rand(1, generator=g)
        x = torch.rand(2 * k, 1, generator=g) * 10 - 5
        y = amp * torch.sin(x + phase)
        out.append((x[:k], y[:k], x[k:], y[k:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--meta-batch", type=int, default=16, help="tasks per step, all ranks")
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--inner-lr", type=float, default=0.01)
    args = ap.parse_args()

    strategy = metadist.strategy(args.strategy)
    world = strategy.world
    if args.meta_batch % world.world_size:
        raise SystemExit(f"--meta-batch {args.meta_batch} must divide by {world.world_size} ranks")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 1))
    model, opt = strategy.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    per_rank = args.meta_batch // world.world_size

    for step in range(args.steps):
        opt.zero_grad()
        mine = tasks(step, args.meta_batch)[world.rank * per_rank:(world.rank + 1) * per_rank]
        meta_loss = torch.zeros(())
        for xs, ys, xq, yq in mine:
            fast = model.full_parameters()
            for _ in range(args.inner_steps):
                loss = nn.functional.mse_loss(model.functional_forward(fast, xs), ys)
                grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
                fast = {n: p - args.inner_lr * g
                        for (n, p), g in zip(fast.items(), grads, strict=True)}
            meta_loss = meta_loss + nn.functional.mse_loss(model.functional_forward(fast, xq), yq)
        strategy.backward(meta_loss / per_rank)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            avg = strategy.all_reduce(meta_loss.detach() / per_rank).item()
            metadist.print(f"step {step:4d}  meta-loss {avg:.4f}")
    metadist.shutdown()


if __name__ == "__main__":
    main()
