"""Hypergradients (metadist.meta: unrolled, darts, neumann, cg) with the inner parameters as
fast weights: ``model.fast_weights()``, whole under one process, shard pieces under
zero3/hsdp. The loss functions are written once; each rank holds its slice of the global
batch and ``grad_sync=strategy.sync_grads``, one process the whole batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import metadist
from metadist.meta import (
    CGConfig,
    DartsConfig,
    NeumannConfig,
    UnrolledConfig,
    hypergradient,
    sgd,
)

FEATURES, SAMPLES = 4, 24  # 24: split over 1, 2, 3 or 4 ranks
DECAY = 1.0  # the inner Hessian positive definite at the start (cg needs it)
CONFIGS: dict[str, Any] = {
    "unrolled": UnrolledConfig(steps=3, optimizer=sgd(0.1)),
    "darts": DartsConfig(xi=0.1, r=0.01),
    "neumann": NeumannConfig(iterations=5, alpha=0.1),
    "cg": CGConfig(iterations=5),
}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 24), nn.Tanh(), nn.Linear(24, 2)).double()


def data() -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    y = torch.sin(x @ torch.randn(FEATURES, 2, generator=g, dtype=torch.float64))
    return x[:SAMPLES], y[:SAMPLES], x[SAMPLES:], y[SAMPLES:]


def _losses(model: Any, xt: Tensor, yt: Tensor, xv: Tensor, yv: Tensor) -> tuple[Any, Any]:
    def inner(fast: Any, lam: tuple[Tensor, ...]) -> Tensor:  # training error + decay
        out = model.functional_forward(fast, xt * lam[0].exp())
        return ((out - yt) ** 2).mean() + DECAY * fast.dot(fast)

    def outer(fast: Any, lam: tuple[Tensor, ...]) -> Tensor:  # validation error
        return ((model.functional_forward(fast, xv * lam[0].exp()) - yv) ** 2).mean()

    return outer, inner


def on_rank(strategy: str, options: dict[str, Any] | None = None) -> dict[str, Tensor]:
    """Every method's hypergradient, this rank holding its slice of the global batch."""
    s = metadist.strategy(strategy, **(options or {}))
    model = net()
    model, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    w = metadist.world()
    mine = [t.chunk(w.world_size)[w.rank] for t in data()]
    outer, inner = _losses(model, *mine)
    lam = torch.full((FEATURES,), 0.1, dtype=torch.float64, requires_grad=True)
    sync = s.sync_grads if w.world_size > 1 else None
    return {name: hypergradient(name, outer, inner, model.fast_weights(), (lam,), config,
                                grad_sync=sync)[0]
            for name, config in CONFIGS.items()}
