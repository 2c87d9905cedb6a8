"""TorchOpt's ``AdaMax``: the torch-style AdaMax (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.adamax import adamax
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["AdaMax", "Adamax"]


class AdaMax(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Any = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, adamax(lr, betas, eps, weight_decay))

Adamax = AdaMax
