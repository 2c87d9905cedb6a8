"""TorchOpt's ``MetaAdaMax``: the differentiable AdaMax (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.adamax import adamax
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaAdaMax", "MetaAdamax"]


class MetaAdaMax(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        moment_requires_grad: bool = True,
    ) -> None:
        super().__init__(module, adamax(
            lr, betas, eps, weight_decay, moment_requires_grad=moment_requires_grad))

MetaAdamax = MetaAdaMax
