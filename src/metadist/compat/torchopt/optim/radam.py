"""TorchOpt's ``RAdam``: the torch-style RAdam (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.radam import radam
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["RAdam"]


class RAdam(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Any = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, radam(lr, betas, eps, weight_decay))
