"""TorchOpt's ``AdaGrad``: the torch-style AdaGrad (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.adagrad import adagrad
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["AdaGrad", "Adagrad"]


class AdaGrad(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Any = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, adagrad(
            lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize=maximize))

Adagrad = AdaGrad
