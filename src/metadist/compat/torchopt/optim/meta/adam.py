"""TorchOpt's ``MetaAdam``: the differentiable Adam (TorchOpt's signature and defaults)."""

from __future__ import annotations

from typing import Any

from torch import nn

from metadist.compat.torchopt.alias.adam import adam
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

__all__ = ["MetaAdam"]


class MetaAdam(MetaOptimizer):
    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        eps_root: float = 0.0,
        moment_requires_grad: bool = True,
        maximize: bool = False,
        use_accelerated_op: bool = False,
    ) -> None:
        super().__init__(module, adam(
            lr, betas, eps, weight_decay, eps_root=eps_root,
            moment_requires_grad=moment_requires_grad, maximize=maximize,
            use_accelerated_op=use_accelerated_op))
