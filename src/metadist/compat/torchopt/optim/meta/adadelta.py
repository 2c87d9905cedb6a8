"""TorchOpt's ``MetaAdaDelta``: the differentiable AdaDelta (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.adadelta import adadelta
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaAdaDelta", "MetaAdadelta"]


class MetaAdaDelta(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        moment_requires_grad: bool = True,
    ) -> None:
        super().__init__(module, adadelta(
            lr, rho, eps, weight_decay, moment_requires_grad=moment_requires_grad))

MetaAdadelta = MetaAdaDelta
