"""Second-order workloads, each written twice: through a metadist strategy on N ranks (using
only the strategy's public API) and as plain single-process PyTorch on the whole batch."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import metadist

TASKS = 12  # meta-batch, split across 1, 2, 3 or 4 ranks
INNER_STEPS, INNER_LR = 5, 0.01
META_STEPS = 10


def sinusoid_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # tanh, not ReLU: second derivatives must not vanish for second-order MAML to matter
    return nn.Sequential(nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                         nn.Linear(40, 1))


def sinusoid_tasks(step: int, k: int = 10) -> list[tuple[torch.Tensor, ...]]:
    """(x_support, y_support, x_query, y_query) of every task of one meta-step."""
    g = torch.Generator().manual_seed(1000 + step)
    tasks = []
    for _ in range(TASKS):
        amp = 0.1 + 4.9 * torch.rand(1, generator=g)
        phase = math.pi * torch.rand(1, generator=g)
        xs = torch.rand(2 * k, 1, generator=g) * 10 - 5
        ys = amp * torch.sin(xs + phase)
        tasks.append((xs[:k], ys[:k], xs[k:], ys[k:]))
    return tasks


def _adapt(forward: Any, params: dict[str, torch.Tensor], x: torch.Tensor,
           y: torch.Tensor) -> dict[str, torch.Tensor]:
    for _ in range(INNER_STEPS):
        loss = ((forward(params, x) - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {n: p - INNER_LR * g for (n, p), g in zip(params.items(), grads, strict=True)}
    return params


def maml_reference(per_task_backward: bool) -> dict[str, torch.Tensor]:
    net = sinusoid_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, params, (x,))

    for step in range(META_STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        for xs, ys, xq, yq in sinusoid_tasks(step):
            fast = _adapt(forward, dict(net.named_parameters()), xs, ys)
            q = ((forward(fast, xq) - yq) ** 2).mean() / TASKS
            if per_task_backward:
                q.backward()
            else:
                total = total + q
        if not per_task_backward:
            total.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def maml_on_rank(strategy: str, per_task_backward: bool,
                 options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    w = metadist.world()
    net = sinusoid_net()
    s = metadist.strategy(strategy, **(options or {}))
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    per = TASKS // w.world_size
    for step in range(META_STEPS):
        opt.zero_grad()
        mine = sinusoid_tasks(step)[w.rank * per:(w.rank + 1) * per]
        total = torch.zeros(())
        for xs, ys, xq, yq in mine:
            fast = _adapt(model.functional_forward, model.full_parameters(), xs, ys)
            q = ((model.functional_forward(fast, xq) - yq) ** 2).mean() / per
            if per_task_backward:
                s.backward(q)
            else:
                total = total + q
        if not per_task_backward:
            s.backward(total)
        opt.step()
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


# ----- gradient-norm penalty: loss + lam * |grad loss|^2 ----------------------------------

PENALTY = 0.1


def _regression(steps: int = 10, batch: int = 24, seed: int = 5) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randn(batch, 2, generator=g))
            for _ in range(steps)]


def _small_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))


def penalty_reference() -> dict[str, torch.Tensor]:
    net = _small_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for x, y in _regression():
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
        (loss + PENALTY * sum((g**2).sum() for g in grads)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def penalty_on_rank(strategy: str, options: dict[str, Any] | None = None
                    ) -> dict[str, torch.Tensor]:
    w = metadist.world()
    net = _small_net()
    s = metadist.strategy(strategy, **(options or {}))
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    for x, y in _regression():
        opt.zero_grad()
        per = x.shape[0] // w.world_size
        xs, ys = x[w.rank * per:(w.rank + 1) * per], y[w.rank * per:(w.rank + 1) * per]
        params = model.full_parameters()
        loss = ((model.functional_forward(params, xs) - ys) ** 2).mean()
        # The gradient of the *global* loss, kept differentiable across ranks.
        grads = s.sync_grads(torch.autograd.grad(loss, list(params.values()), create_graph=True))
        s.backward(loss + PENALTY * sum((g**2).sum() for g in grads))
        opt.step()
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


# ----- hypergradient of a validation loss through one unrolled training step -------------

ALPHA, HYPER_LR = 0.1, 0.5


def hyper_reference() -> tuple[dict[str, torch.Tensor], float, list[float]]:
    net = _small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    log_decay = torch.tensor(-3.0, requires_grad=True)

    def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, params, (x,))

    hypers = []
    for x, y in _regression():
        params = dict(net.named_parameters())
        half = x.shape[0] // 2
        train = ((forward(params, x[:half]) - y[:half]) ** 2).mean() + log_decay.exp() * sum(
            (p**2).sum() for p in params.values())
        grads = torch.autograd.grad(train, list(params.values()), create_graph=True)
        fast = {n: p - ALPHA * g for (n, p), g in zip(params.items(), grads, strict=True)}
        val = ((forward(fast, x[half:]) - y[half:]) ** 2).mean()
        (hyper,) = torch.autograd.grad(val, log_decay)
        hypers.append(hyper.item())
        with torch.no_grad():
            log_decay -= HYPER_LR * hyper
        opt.zero_grad()
        train = ((net(x[:half]) - y[:half]) ** 2).mean() + log_decay.detach().exp() * sum(
            (p**2).sum() for p in net.parameters())
        train.backward()
        opt.step()
    return ({n: p.detach().clone() for n, p in net.named_parameters()}, log_decay.item(), hypers)


def hyper_on_rank(strategy: str, options: dict[str, Any] | None = None
                  ) -> tuple[dict[str, torch.Tensor], float, list[float]]:
    """Each rank holds a slice of the training half and of the validation half of every batch."""
    w = metadist.world()
    net = _small_net()
    s = metadist.strategy(strategy, **(options or {}))
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    log_decay = torch.tensor(-3.0, requires_grad=True)
    hypers = []
    for x, y in _regression():
        half = x.shape[0] // 2
        per = half // w.world_size
        lo, hi = w.rank * per, (w.rank + 1) * per
        xt, yt, xv, yv = x[:half][lo:hi], y[:half][lo:hi], x[half:][lo:hi], y[half:][lo:hi]
        params = model.full_parameters()
        train = ((model.functional_forward(params, xt) - yt) ** 2).mean() + log_decay.exp() * sum(
            (p**2).sum() for p in params.values())
        grads = s.sync_grads(torch.autograd.grad(train, list(params.values()),
                                                 create_graph=True))
        fast = {n: p - ALPHA * g for (n, p), g in zip(params.items(), grads, strict=True)}
        val = ((model.functional_forward(fast, xv) - yv) ** 2).mean()
        (hyper,) = s.sync_grads(torch.autograd.grad(val, log_decay))
        hypers.append(hyper.item())
        with torch.no_grad():
            log_decay -= HYPER_LR * hyper
        opt.zero_grad()
        # Each rank's loss carries the decay term in full: the strategy averages gradients.
        train = ((model(xt) - yt) ** 2).mean() + log_decay.detach().exp() * sum(
            (p**2).sum() for p in model.full_parameters().values())
        s.backward(train)
        opt.step()
    return ({n: p.detach().clone() for n, p in model.full_parameters().items()},
            log_decay.item(), hypers)
