"""iMAML laid out as TorchOpt's distributed examples are (rank 0 drives under
``@todist.rank_zero_only`` inside ``@todist.auto_init_rpc()``, the tasks run where
``parallelize`` sends them), each task's inner problem differentiated implicitly by
``torchopt.diff.implicit.custom_root``. Only the imports are metadist's.

    python -m metadist run --nproc 2 tests/torchopt_programs/imaml_distributed.py --out r.pt

Float64, a small MLP, synthetic regression tasks; rank 0 saves the final parameters and the
meta-losses. ``run_tasks`` is also what the one-process reference calls, task by task.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import metadist.compat.torchopt as torchopt  # noqa: PLR0402 - mirrors "import torchopt"
import metadist.compat.torchopt.distributed as todist

TASKS, INNER_STEPS, INNER_LR, REG, META_LR = 4, 20, 0.3, 1.0, 0.05


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def sample_tasks(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(500 + step)
    w = torch.randn(TASKS, 3, 1, generator=g, dtype=torch.float64)
    x_spt = torch.randn(TASKS, 10, 3, generator=g, dtype=torch.float64)
    x_qry = torch.randn(TASKS, 10, 3, generator=g, dtype=torch.float64)
    return x_spt, torch.tanh(x_spt @ w), x_qry, torch.tanh(x_qry @ w)


def _objective(params: tuple, meta: tuple, net: nn.Module, names: tuple, x: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
    pred = functional_call(net, dict(zip(names, params, strict=True)), (x,))
    reg = sum(0.5 * REG * ((p - m) ** 2).sum() for p, m in zip(params, meta, strict=True))
    return F.mse_loss(pred, y) + reg


def _optimality(params: tuple, meta: tuple, net: nn.Module, names: tuple, x: torch.Tensor,
                y: torch.Tensor) -> tuple:
    return torch.func.grad(_objective)(params, meta, net, names, x, y)  # type: ignore[no-any-return]


@torchopt.diff.implicit.custom_root(_optimality, argnums=1,
                                    solve=torchopt.linear_solve.solve_cg(maxiter=30, atol=0))
def _solve(params: tuple, meta: tuple, net: nn.Module, names: tuple, x: torch.Tensor,
           y: torch.Tensor) -> tuple:
    opt = torchopt.sgd(lr=INNER_LR)
    state = opt.init(params)
    with torch.enable_grad():
        for _ in range(INNER_STEPS):
            grads = torch.autograd.grad(_objective(params, meta, net, names, x, y), params)
            updates, state = opt.update(grads, state, inplace=False)
            params = torchopt.apply_updates(params, updates, inplace=False)
    return params


def run_task(net: nn.Module, x_spt: torch.Tensor, y_spt: torch.Tensor, x_qry: torch.Tensor,
             y_qry: torch.Tensor) -> torch.Tensor:
    """One task: the inner solution from the meta-parameters, its query loss. The module is
    cloned (by reference: the same tensors) because tasks on one worker run concurrently and
    functional_call swaps the tensors of the module it is given for the call."""
    net = torchopt.module_clone(net, by="reference")
    names, meta = zip(*net.named_parameters(), strict=True)
    init = tuple(m.detach().clone().requires_grad_() for m in meta)
    solution = _solve(init, tuple(meta), net, names, x_spt, y_spt)
    pred = functional_call(net, dict(zip(names, solution, strict=True)), (x_qry,))
    return F.mse_loss(pred, y_qry)


@todist.parallelize(partitioner=todist.dim_partitioner(0, exclusive=True, keepdim=False),
                    reducer=todist.mean_reducer)
def inner_loop(net_rref: todist.rpc.RRef, x_spt: torch.Tensor, y_spt: torch.Tensor,
               x_qry: torch.Tensor, y_qry: torch.Tensor) -> torch.Tensor:
    print(f"task on {todist.get_world_info().worker_name}", flush=True)
    return run_task(net_rref.to_here(), x_spt, y_spt, x_qry, y_qry)


@todist.rank_zero_only
def run(args: argparse.Namespace) -> None:
    net = build_model()
    meta_opt = torch.optim.SGD(net.parameters(), lr=META_LR)
    losses = []
    for step in range(args.steps):
        meta_opt.zero_grad()
        net_rref = todist.rpc.RRef(torchopt.module_clone(net, by="copy"))
        with todist.autograd.context() as context_id:
            loss = inner_loop(net_rref, *sample_tasks(step))
            todist.autograd.backward(context_id, loss)
        meta_opt.step()
        losses.append(loss.item())
    torch.save({"params": [p.detach().clone() for p in net.parameters()], "losses": losses,
                "world_size": todist.get_world_size()}, args.out)


@todist.auto_init_rpc()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
