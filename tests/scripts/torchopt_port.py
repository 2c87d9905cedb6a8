"""MAML written for TorchOpt's ``torchopt.distributed`` API; the import line below is the only
change (it read ``import torchopt.distributed as todist``).

    metadist run --nproc 2 torchopt_port.py                      # every rank drives (spmd)
    METADIST_MAPREDUCE_ENGINE=rpc metadist run --nproc 2 torchopt_port.py --driver rank0

With ``--driver rank0`` only rank 0 trains and the others serve its calls, TorchOpt's usual
layout (which needs the rpc engine). Prints one ``result`` line from rank 0.
"""

import argparse
import copy
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import metadist.mapreduce as todist  # was: import torchopt.distributed as todist

K, INNER_STEPS, INNER_LR = 5, 3, 0.05


def worker_init() -> None:
    # TorchOpt's examples seed each worker differently here; training re-seeds below.
    torch.manual_seed(todist.get_world_info().local_rank)
    os.environ["PORT_TEST_WORKER"] = todist.get_world_info().worker_name


def transpose_mean_reducer(results: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, int]:
    losses, sizes = tuple(zip(*results, strict=True))
    return torch.mean(torch.stack(losses)), sum(sizes)


@todist.parallelize(
    partitioner=todist.dim_partitioner(dim=0, exclusive=True, keepdim=False),
    reducer=transpose_mean_reducer,
)
def inner_loop(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    params = dict(net.named_parameters())
    for _ in range(INNER_STEPS):
        loss = F.mse_loss(functional_call(net, params, (x[:K],)), y[:K])
        grads = torch.autograd.grad(loss, tuple(params.values()), create_graph=True)
        params = {name: p - INNER_LR * g
                  for (name, p), g in zip(params.items(), grads, strict=True)}
    return F.mse_loss(functional_call(net, params, (x[K:],)), y[K:]), x.shape[0]


@todist.parallelize(partitioner=todist.batch_partitioner, reducer=todist.mean_reducer)
def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.mse_loss(net(x.reshape(-1, 1)), y.reshape(-1, 1))


def clone_for_rpc(net: nn.Module) -> nn.Module:
    """What ``torchopt.module_clone(net, by="copy")`` does: a plain ``nn.Parameter`` sent
    over RPC arrives detached, so send a copy holding differentiable clones instead."""
    return copy.deepcopy(net, {id(p): p.clone() for p in net.parameters()})


def tasks(step: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    amplitude = 0.5 + 4.5 * torch.rand(count, 1, 1, generator=g)
    x = torch.rand(count, 2 * K, 1, generator=g) * 10 - 5
    return x, amplitude * torch.sin(x)


@todist.rank_zero_only
def log(text: str) -> None:
    print(text, flush=True)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    seen = 0
    for step in range(args.steps):
        x, y = tasks(step, args.tasks)
        with todist.autograd.context() as context_id:
            loss, count = inner_loop(clone_for_rpc(net), x, y)
            todist.autograd.backward(context_id, loss)
        with torch.no_grad():  # SGD by hand: torch.optim's first use costs seconds here
            for p in net.parameters():
                p.sub_(0.05 * p.grad)
                p.grad = None
        seen += count
    x, y = tasks(10_000, 8)
    test = todist.remote_sync_call(evaluate, args=(net, x, y),
                                   partitioner=todist.batch_partitioner,
                                   reducer=todist.mean_reducer)
    checksum = sum(p.double().sum().item() for p in net.parameters())
    log(f"result engine={os.environ.get('METADIST_MAPREDUCE_ENGINE', 'spmd')} "
        f"world={todist.get_world_size()} loss={loss.item():.8f} test={test.item():.8f} "
        f"checksum={checksum:.8f} points={seen} worker={os.environ['PORT_TEST_WORKER']}")


train_on_rank0 = todist.rank_zero_only(train)


@todist.auto_init_rpc(worker_init)
def main() -> Any:
    parser = argparse.ArgumentParser()
    parser.add_argument("--driver", choices=["all", "rank0"], default="all")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=5)
    args = parser.parse_args()
    todist.barrier()
    (train if args.driver == "all" else train_on_rank0)(args)


if __name__ == "__main__":
    main()
