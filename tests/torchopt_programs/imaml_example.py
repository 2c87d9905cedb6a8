"""TorchOpt 0.7.3's iMAML examples (examples/iMAML/imaml_omniglot.py, the module form on
``ImplicitMetaGradientModule``, and imaml_omniglot_functional.py, the functional form on
``custom_root``), ported for the comparison with TorchOpt itself: written against ``import
torchopt`` (as_compat.py runs them on the drop-in). ``--form module|functional``.

What is the examples': the model (3 conv blocks with bias, BatchNorm without running
statistics), the inner problem (cross-entropy plus ``reg_param/2 |params - meta|^2`` by SGD lr
0.1 for ``--inner-steps``, implicit gradients by ``solve_normal_cg(maxiter=5, atol=0)``), the
meta-optimiser (Adam 1e-3: ``torchopt.Adam`` on the module, ``torchopt.adam`` functionally),
and training and testing as they do them. What is not: the Omniglot loader (synthetic tasks:
per class a random prototype image plus noise) and the sizes. ``--dtype float64`` runs the
same program in double precision. ``--out``: every train and test loss and accuracy and the
final parameters' sums, as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import functorch
import numpy as np
import torch
import torch.nn.functional as F
import torchopt
from torch import nn
from torchopt import pytree
from torchopt.diff.implicit import ImplicitMetaGradientModule


class InnerNet(ImplicitMetaGradientModule,
               linear_solve=torchopt.linear_solve.solve_normal_cg(maxiter=5, atol=0)):
    def __init__(self, meta_net: nn.Module, n_inner_iter: int, reg_param: float) -> None:
        super().__init__()
        self.meta_net = meta_net
        self.net = torchopt.module_clone(meta_net, by="deepcopy", detach_buffers=True)
        self.n_inner_iter = n_inner_iter
        self.reg_param = reg_param
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p1, p2 in zip(self.parameters(), self.meta_parameters(), strict=True):
                p1.data.copy_(p2.data)
                p1.detach_().requires_grad_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        reg = sum(0.5 * self.reg_param * torch.sum(torch.square(p1 - p2))
                  for p1, p2 in zip(self.parameters(), self.meta_parameters(), strict=True))
        return F.cross_entropy(self(x), y) + reg

    def solve(self, x: torch.Tensor, y: torch.Tensor) -> InnerNet:
        params = tuple(self.parameters())
        inner_optim = torchopt.SGD(params, lr=1e-1)
        with torch.enable_grad():
            for _ in range(self.n_inner_iter):
                loss = self.objective(x, y)
                inner_optim.zero_grad()
                loss.backward(inputs=params)
                inner_optim.step()
        return self


def imaml_objective(params: tuple, meta_params: tuple, data: tuple, aux: tuple
                    ) -> torch.Tensor:
    (x, y), (fnet, _, reg_param) = data, aux
    reg = sum(0.5 * reg_param * torch.sum(torch.square(p1 - p2))
              for p1, p2 in zip(params, meta_params, strict=True))
    return F.cross_entropy(fnet(params, x), y) + reg


def _inner_sgd(params: tuple, meta_params: tuple, data: tuple, aux: tuple) -> tuple:
    opt = torchopt.sgd(lr=1e-1)
    state = opt.init(params)
    with torch.enable_grad():
        for _ in range(aux[1]):
            grads = torch.autograd.grad(imaml_objective(params, meta_params, data, aux), params)
            updates, state = opt.update(grads, state, inplace=True)
            params = torchopt.apply_updates(params, updates, inplace=True)
    return params


@torchopt.diff.implicit.custom_root(
    functorch.grad(imaml_objective, argnums=0), argnums=1, has_aux=False,
    solve=torchopt.linear_solve.solve_normal_cg(maxiter=5, atol=0))
def train_imaml_inner_solver(params: tuple, meta_params: tuple, data: tuple, aux: tuple
                             ) -> tuple:
    return _inner_sgd(params, meta_params, data, aux)


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
            x = (protos + 0.5 * noise).reshape(a.tasks, a.n_way * shots, 1, 28, 28)
            return x.to(a.dtype), order.repeat_interleave(shots, dim=1)

        return (*draw(a.k_spt), *draw(a.k_qry))


def build_model(args: argparse.Namespace) -> nn.Module:
    layers: list[nn.Module] = []
    for c_in in (1, args.channels, args.channels):
        layers += [nn.Conv2d(c_in, args.channels, 3),
                   nn.BatchNorm2d(args.channels, momentum=1.0, track_running_stats=False),
                   nn.ReLU(inplace=False), nn.MaxPool2d(2, 2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(args.channels, args.n_way)).to(
        args.dtype)


def run_module(args: argparse.Namespace, db: Tasks, log: dict) -> list[torch.Tensor]:
    net = build_model(args)
    net.train()
    meta_opt = torchopt.Adam(net.parameters(), lr=1e-3)

    def test() -> None:
        losses, accs = [], []
        for _ in range(args.test_iters):
            x_spt, y_spt, x_qry, y_qry = db.next("test")
            for i in range(x_spt.size(0)):
                inner = InnerNet(net, args.inner_steps, args.reg_params)
                with torch.no_grad():
                    solved = inner.solve(x_spt[i], y_spt[i])
                logits = solved(x_qry[i])
                losses.append(F.cross_entropy(logits, y_qry[i]).item())
                accs.append((logits.argmax(dim=1) == y_qry[i]).float().mean().item())
        log["test"].append([float(np.mean(losses)), float(np.mean(accs))])

    test()
    for _ in range(args.epochs):
        inner_nets = [InnerNet(net, args.inner_steps, args.reg_params)
                      for _ in range(args.tasks)]
        for _ in range(args.train_iters):
            start = time.perf_counter()
            x_spt, y_spt, x_qry, y_qry = db.next()
            losses, accs = [], []
            meta_opt.zero_grad()
            for i in range(args.tasks):
                inner_nets[i].reset_parameters()
                solved = inner_nets[i].solve(x_spt[i], y_spt[i])
                logits = solved(x_qry[i])
                losses.append(F.cross_entropy(logits, y_qry[i]))
                accs.append((logits.argmax(dim=1) == y_qry[i]).float().mean().item())
            loss = torch.mean(torch.stack(losses))
            loss.backward()
            meta_opt.step()
            log["train"].append([loss.item(), float(np.mean(accs))])
            log["step_s"].append(time.perf_counter() - start)
        test()
    return list(net.parameters())


def run_functional(args: argparse.Namespace, db: Tasks, log: dict) -> list[torch.Tensor]:
    net = build_model(args)
    net.train()
    fnet, meta_params = functorch.make_functional(net)
    meta_opt = torchopt.adam(lr=1e-3)
    meta_state = meta_opt.init(meta_params)

    def fresh(params: tuple) -> tuple:
        return pytree.tree_map(
            lambda t: t.clone().detach_().requires_grad_(requires_grad=t.requires_grad), params)

    def test(meta_params: tuple) -> None:
        losses, accs = [], []
        for _ in range(args.test_iters):
            x_spt, y_spt, x_qry, y_qry = db.next("test")
            for i in range(x_spt.size(0)):
                params = _inner_sgd(fresh(meta_params), meta_params, (x_spt[i], y_spt[i]),
                                    (fnet, args.inner_steps, args.reg_params))
                logits = fnet(params, x_qry[i])
                losses.append(F.cross_entropy(logits, y_qry[i]).item())
                accs.append((logits.argmax(dim=1) == y_qry[i]).float().mean().item())
        log["test"].append([float(np.mean(losses)), float(np.mean(accs))])

    test(meta_params)
    for _ in range(args.epochs):
        for _ in range(args.train_iters):
            start = time.perf_counter()
            x_spt, y_spt, x_qry, y_qry = db.next()
            losses, accs = [], []
            for i in range(args.tasks):
                params = train_imaml_inner_solver(fresh(meta_params), meta_params,
                                                  (x_spt[i], y_spt[i]),
                                                  (fnet, args.inner_steps, args.reg_params))
                logits = fnet(params, x_qry[i])
                losses.append(F.cross_entropy(logits, y_qry[i]))
                accs.append((logits.argmax(dim=1) == y_qry[i]).float().mean().item())
            loss = torch.mean(torch.stack(losses))
            grads = torch.autograd.grad(loss, meta_params)
            updates, meta_state = meta_opt.update(grads, meta_state)
            meta_params = torchopt.apply_updates(meta_params, updates)
            log["train"].append([loss.item(), float(np.mean(accs))])
            log["step_s"].append(time.perf_counter() - start)
        test(meta_params)
    return list(meta_params)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--form", choices=("module", "functional"), default="module")
    parser.add_argument("--n-way", dest="n_way", type=int, default=5)
    parser.add_argument("--k-spt", dest="k_spt", type=int, default=1)
    parser.add_argument("--k-qry", dest="k_qry", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--inner-steps", dest="inner_steps", type=int, default=5)
    parser.add_argument("--reg-params", dest="reg_params", type=float, default=2.0)
    parser.add_argument("--train-iters", dest="train_iters", type=int, default=3)
    parser.add_argument("--test-iters", dest="test_iters", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    log: dict[str, list] = {"train": [], "test": [], "step_s": []}
    run = run_module if args.form == "module" else run_functional
    params = run(args, Tasks(args), log)
    log["params"] = [float(p.detach().double().sum()) for p in params]
    with open(args.out, "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()
