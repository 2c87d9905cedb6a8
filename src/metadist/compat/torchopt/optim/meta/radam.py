"""TorchOpt's ``MetaRAdam``: the differentiable RAdam (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.radam import radam
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaRAdam"]


class MetaRAdam(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        moment_requires_grad: bool = True,
    ) -> None:
        super().__init__(module, radam(
            lr, betas, eps, weight_decay, moment_requires_grad=moment_requires_grad))
