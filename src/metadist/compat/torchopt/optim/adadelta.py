"""TorchOpt's ``AdaDelta``: the torch-style AdaDelta (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.adadelta import adadelta
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["AdaDelta", "Adadelta"]


class AdaDelta(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Any = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, adadelta(lr, rho, eps, weight_decay))

Adadelta = AdaDelta
