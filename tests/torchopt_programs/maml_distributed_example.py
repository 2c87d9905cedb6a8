"""TorchOpt 0.7.3's distributed few-shot example (examples/distributed/few-shot/
maml_omniglot.py), ported for the comparison with TorchOpt itself: written against
``import torchopt`` and ``import torchopt.distributed as todist``, run on TorchOpt under
torchrun and on the drop-in under ``metadist run`` (through as_compat.py, which makes
``import torchopt`` resolve to metadist.compat.torchopt).

What is TorchOpt's example's: the layout (rank 0 drives under ``@todist.rank_zero_only``
inside ``@todist.auto_init_rpc(worker_init)``, workers seeded by local rank), the model (3 conv
blocks with bias, BatchNorm momentum 1.0, float32), the inner loop (``parallelize`` with an
exclusive ``dim_partitioner(0, keepdim=False)``, ``module_clone(net_rref.to_here(),
by='reference', detach_buffers=True)``, ``MetaSGD`` lr 0.1, 5 steps; the query loss and
accuracy reduced by a transposing mean), training (``RRef(module_clone(net, by='copy'))``,
``todist.autograd.backward`` and Adam's step inside the context) and testing (``RRef(net)``
itself, net in train mode), a test before training and after each epoch. What is not: the
Omniglot loader (synthetic tasks: per class a random prototype image plus noise) and the sizes
(``--channels``, ``--tasks``, ``--train-iters``, ``--test-iters``, ``--epochs``).

    torchrun --nproc_per_node 2 maml_distributed_example.py --out real.json
    metadist run --nproc 2 as_compat.py maml_distributed_example.py --out compat.json

Rank 0 writes every train and test loss and accuracy, the absolute sum of every parameter's
gradient at every step, and the final parameters' sums.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
import torchopt
import torchopt.distributed as todist
from torch import nn


def worker_init() -> None:
    seed = todist.get_world_info().local_rank
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(n_way: int, channels: int) -> nn.Module:
    layers: list[nn.Module] = []
    for c_in in (1, channels, channels):
        layers += [nn.Conv2d(c_in, channels, 3), nn.BatchNorm2d(channels, momentum=1.0),
                   nn.ReLU(inplace=False), nn.MaxPool2d(2, 2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels, n_way))


class Tasks:
    """Omniglot-shaped few-shot tasks from a seeded generator, train and test streams."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = {"train": torch.Generator().manual_seed(args.seed),
                    "test": torch.Generator().manual_seed(args.seed + 1)}

    def next(self, mode: str = "train") -> tuple[torch.Tensor, ...]:
        a, g = self.args, self.rng[mode]
        protos = torch.rand(a.tasks, a.n_way, 1, 1, 28, 28, generator=g)

        def draw(shots: int) -> tuple[torch.Tensor, torch.Tensor]:
            order = torch.stack([torch.randperm(a.n_way, generator=g) for _ in range(a.tasks)])
            noise = torch.randn(a.tasks, a.n_way, shots, 1, 28, 28, generator=g)
            x = (protos + 0.6 * noise).reshape(a.tasks, a.n_way * shots, 1, 28, 28)
            y = order.repeat_interleave(shots, dim=1)
            return x, y

        return (*draw(a.k_spt), *draw(a.k_qry))


def transpose_mean_reducer(results: list[tuple[torch.Tensor, float]]
                           ) -> tuple[torch.Tensor, float]:
    losses, accs = tuple(zip(*results, strict=True))
    return torch.mean(torch.stack(losses)), float(np.mean(accs))


@todist.parallelize(partitioner=todist.dim_partitioner(dim=0, exclusive=True, keepdim=False),
                    reducer=transpose_mean_reducer)
def inner_loop(net_rref: todist.rpc.RRef, x_spt: torch.Tensor, y_spt: torch.Tensor,
               x_qry: torch.Tensor, y_qry: torch.Tensor, n_inner_iter: int
               ) -> tuple[torch.Tensor, float]:
    net = torchopt.module_clone(net_rref.to_here(), by="reference", detach_buffers=True)
    inner_opt = torchopt.MetaSGD(net, lr=1e-1)
    for _ in range(n_inner_iter):
        inner_opt.step(F.cross_entropy(net(x_spt), y_spt))
    logits = net(x_qry)
    return F.cross_entropy(logits, y_qry), (logits.argmax(dim=1) == y_qry).float().mean().item()


@todist.rank_zero_only
def train(db: Tasks, net: nn.Module, meta_opt: torch.optim.Optimizer, log: dict) -> None:
    net.train()
    for _ in range(db.args.train_iters):
        x_spt, y_spt, x_qry, y_qry = db.next()
        meta_opt.zero_grad()
        net_rref = todist.rpc.RRef(torchopt.module_clone(net, by="copy"))
        with todist.autograd.context() as context_id:
            loss, acc = inner_loop(net_rref, x_spt, y_spt, x_qry, y_qry, 5)
            todist.autograd.backward(context_id, loss)
            log["grads"].append([float(p.grad.double().abs().sum()) for p in net.parameters()])
            meta_opt.step()
        log["train"].append([loss.item(), acc])


@todist.rank_zero_only
def test(db: Tasks, net: nn.Module, log: dict) -> None:
    net.train()
    net_rref = todist.rpc.RRef(net)
    losses, accs = [], []
    for _ in range(db.args.test_iters):
        x_spt, y_spt, x_qry, y_qry = db.next("test")
        loss, acc = inner_loop(net_rref, x_spt, y_spt, x_qry, y_qry, 5)
        losses.append(loss.item())
        accs.append(acc)
    log["test"].append([float(np.mean(losses)), float(np.mean(accs))])


@todist.rank_zero_only
def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    db = Tasks(args)
    net = build_model(args.n_way, args.channels)
    meta_opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    log: dict = {"train": [], "test": [], "grads": []}
    test(db, net, log)
    for _ in range(args.epochs):
        train(db, net, meta_opt, log)
        test(db, net, log)
    log["params"] = [float(p.detach().double().sum()) for p in net.parameters()]
    with open(args.out, "w") as f:
        json.dump(log, f)


@todist.auto_init_rpc(worker_init)
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-way", dest="n_way", type=int, default=5)
    parser.add_argument("--k-spt", dest="k_spt", type=int, default=1)
    parser.add_argument("--k-qry", dest="k_qry", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--train-iters", dest="train_iters", type=int, default=4)
    parser.add_argument("--test-iters", dest="test_iters", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
