"""TorchOpt's ``MetaAdamW``: the differentiable AdamW (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.adamw import adamw
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaAdamW"]


class MetaAdamW(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        eps_root: float = 0.0,
        mask: Any = None,
        moment_requires_grad: bool = False,
        maximize: bool = False,
        use_accelerated_op: bool = False,
    ) -> None:
        super().__init__(module, adamw(
            lr, betas, eps, weight_decay, eps_root=eps_root, mask=mask,
            moment_requires_grad=moment_requires_grad, maximize=maximize,
            use_accelerated_op=use_accelerated_op))
