"""TorchOpt's ``MetaSGD``: the differentiable SGD (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.sgd import sgd
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaSGD"]


class MetaSGD(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        moment_requires_grad: bool = True,
        maximize: bool = False,
    ) -> None:
        super().__init__(module, sgd(
            lr, momentum, dampening, weight_decay, nesterov,
            moment_requires_grad=moment_requires_grad, maximize=maximize))
