"""TorchOpt's ``SGD``: the torch-style SGD (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.sgd import sgd
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["SGD"]


class SGD(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Any,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, sgd(
            lr, momentum, dampening, weight_decay, nesterov, maximize=maximize))
