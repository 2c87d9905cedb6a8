"""TorchOpt's ``MetaRMSProp``: the differentiable RMSProp (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.rmsprop import rmsprop
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaRMSProp", "MetaRMSprop"]


class MetaRMSProp(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        initial_scale: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
    ) -> None:
        super().__init__(module, rmsprop(
            lr, alpha, eps, weight_decay, momentum, centered, initial_scale=initial_scale,
            nesterov=nesterov, maximize=maximize))

MetaRMSprop = MetaRMSProp
