"""TorchOpt's ``adadelta``."""

from __future__ import annotations

from typing import Any

from metadist.compat.torchopt.alias.utils import (
    build,
    check,
    flip_sign_and_add_weight_decay,
    scale_by_neg_lr,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform import scale_by_adadelta

__all__ = ["adadelta"]


def adadelta(lr: Any = 1e-3, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
             *, moment_requires_grad: bool = False) -> GradientTransformation:
    """AdaDelta with L2 weight decay (TorchOpt's default lr, 1e-3; torch's is 1.0)."""
    if not 0 <= rho <= 1:
        raise ValueError(f"Invalid rho value: {rho}")
    check(lr, weight_decay, eps)
    return build((flip_sign_and_add_weight_decay, {"weight_decay": weight_decay,
                                                   "maximize": False}),
                 (scale_by_adadelta, {"rho": rho, "eps": eps,
                                      "moment_requires_grad": moment_requires_grad}),
                 (scale_by_neg_lr, {"lr": lr}))
