"""TorchOpt's ``MetaAdaGrad``: the differentiable AdaGrad (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.adagrad import adagrad
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaAdaGrad", "MetaAdagrad"]


class MetaAdaGrad(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(module, adagrad(
            lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize=maximize))

MetaAdagrad = MetaAdaGrad
