"""TorchOpt's ``RMSProp``: the torch-style RMSProp (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.rmsprop import rmsprop
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["RMSProp", "RMSprop"]


class RMSProp(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
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
        super().__init__(params, rmsprop(
            lr, alpha, eps, weight_decay, momentum, centered, initial_scale=initial_scale,
            nesterov=nesterov, maximize=maximize))

RMSprop = RMSProp
