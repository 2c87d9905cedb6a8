"""Few-shot MAML laid out as TorchOpt's distributed examples are: rank 0 drives under
``@todist.rank_zero_only`` inside ``@todist.auto_init_rpc()``, the other ranks serve the
per-task inner loops. Only the imports are metadist's (``torchopt`` and
``torchopt.distributed``).

    python -m metadist run --nproc 2 tests/torchopt_programs/maml_omniglot.py --out result.pt

Synthetic Omniglot-shaped tasks (1x28x28, 5-way 1-shot), float64, a small conv net with
BatchNorm; rank 0 saves the final parameters, the meta-losses and an evaluation loss.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import metadist.compat.torchopt as torchopt  # noqa: PLR0402 - mirrors "import torchopt"
import metadist.compat.torchopt.distributed as todist

N_WAY, K_SPT, K_QRY, TASKS, INNER_STEPS = 5, 1, 3, 4, 2
INNER_LR, META_LR = 0.4, 0.1


def worker_init() -> None:
    print(f"worker init: {todist.get_world_info().worker_name}", flush=True)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for channels_in in (1, 8, 8):  # 28 -> 13 -> 5 -> 1
        blocks += [nn.Conv2d(channels_in, 8, 3), nn.BatchNorm2d(8, momentum=1.0), nn.ReLU(),
                   nn.MaxPool2d(2)]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(8, N_WAY)).double()


def sample_tasks(step: int) -> tuple[torch.Tensor, ...]:
    """Support and query sets of ``TASKS`` tasks: per class a random prototype image, each
    sample the prototype plus noise."""
    g = torch.Generator().manual_seed(1000 + step)
    prototypes = torch.rand(TASKS, N_WAY, 1, 1, 28, 28, generator=g, dtype=torch.float64)

    def draw(shots: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(TASKS, N_WAY, shots, 1, 28, 28, generator=g, dtype=torch.float64)
        x = (prototypes + 0.5 * noise).reshape(TASKS, N_WAY * shots, 1, 28, 28)
        y = torch.arange(N_WAY).repeat_interleave(shots).expand(TASKS, -1).contiguous()
        return x, y

    return (*draw(K_SPT), *draw(K_QRY))


@todist.parallelize(partitioner=todist.dim_partitioner(0, exclusive=True, keepdim=False),
                    reducer=todist.mean_reducer)
def inner_loop(net_rref: todist.rpc.RRef, x_spt: torch.Tensor, y_spt: torch.Tensor,
               x_qry: torch.Tensor, y_qry: torch.Tensor, n_inner_iter: int) -> torch.Tensor:
    """Adapt a clone of the meta-model to one task's support set; its query loss."""
    print(f"task on {todist.get_world_info().worker_name}", flush=True)
    net = torchopt.module_clone(net_rref.to_here(), by="reference", detach_buffers=True)
    inner_opt = torchopt.MetaSGD(net, lr=INNER_LR)
    for _ in range(n_inner_iter):
        inner_opt.step(F.cross_entropy(net(x_spt), y_spt))
    return F.cross_entropy(net(x_qry), y_qry)


@todist.rank_zero_only
def train(net: nn.Module, meta_opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        x_spt, y_spt, x_qry, y_qry = sample_tasks(step)
        meta_opt.zero_grad()
        # Parameters pickled by RPC arrive detached: send a differentiable copy (TorchOpt's
        # example does the same with torchopt.module_clone(net, by='copy')).
        net_rref = todist.rpc.RRef(torchopt.module_clone(net, by="copy"))
        with todist.autograd.context() as context_id:
            loss = inner_loop(net_rref, x_spt, y_spt, x_qry, y_qry, INNER_STEPS)
            todist.autograd.backward(context_id, loss)
            grads = todist.autograd.get_gradients(context_id)
        for p in net.parameters():
            p.grad = grads[p]
        meta_opt.step()
        losses.append(loss.item())
        print(f"step {step} meta-loss {losses[-1]:.6f}", flush=True)
    return losses


@todist.rank_zero_only
def evaluate(net: nn.Module) -> float:
    """Query loss after adaptation on new tasks; the module itself travels (as in TorchOpt's
    test(): no gradient is needed)."""
    net_rref = todist.rpc.RRef(net)
    x_spt, y_spt, x_qry, y_qry = sample_tasks(10_000)
    return float(inner_loop(net_rref, x_spt, y_spt, x_qry, y_qry, INNER_STEPS).item())


@todist.rank_zero_only
def run(args: argparse.Namespace) -> None:
    net = build_model()
    meta_opt = torch.optim.SGD(net.parameters(), lr=META_LR, momentum=0.9)
    losses = train(net, meta_opt, args.steps)
    params = [p.detach().clone() for p in net.parameters()]
    evaluation = evaluate(net)
    torch.save({"params": params, "losses": losses, "eval": evaluation,
                "world_size": todist.get_world_size()}, args.out)
    print(f"done on {todist.get_world_size()} worker(s): eval loss {evaluation:.6f}", flush=True)


@todist.auto_init_rpc(worker_init)
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
