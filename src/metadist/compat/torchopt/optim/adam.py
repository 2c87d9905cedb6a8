"""TorchOpt's ``Adam``: the torch-style Adam (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.adam import adam
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["Adam"]


class Adam(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Any = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        eps_root: float = 0.0,
        maximize: bool = False,
        use_accelerated_op: bool = False,
    ) -> None:
        super().__init__(params, adam(
            lr, betas, eps, weight_decay, eps_root=eps_root, maximize=maximize,
            use_accelerated_op=use_accelerated_op))
