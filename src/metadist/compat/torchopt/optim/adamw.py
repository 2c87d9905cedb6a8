"""TorchOpt's ``AdamW``: the torch-style AdamW (TorchOpt's signature and defaults)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt.alias.adamw import adamw
from metadist.compat.torchopt.optim.base import Optimizer

__all__ = ["AdamW"]


class AdamW(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Any = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        eps_root: float = 0.0,
        mask: Any = None,
        maximize: bool = False,
        use_accelerated_op: bool = False,
    ) -> None:
        super().__init__(params, adamw(
            lr, betas, eps, weight_decay, eps_root=eps_root, mask=mask, maximize=maximize,
            use_accelerated_op=use_accelerated_op))
