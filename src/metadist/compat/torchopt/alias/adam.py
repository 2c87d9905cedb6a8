"""TorchOpt's ``adam``."""

from __future__ import annotations

from typing import Any

from metadist.compat.torchopt.alias.utils import (
    build,
    check,
    flip_sign_and_add_weight_decay,
    scale_by_neg_lr,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform import scale_by_accelerated_adam, scale_by_adam

__all__ = ["adam"]


def _betas(betas: tuple[float, float]) -> tuple[float, float]:
    b1, b2 = betas
    for i, b in enumerate((b1, b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    return b1, b2


def adam(lr: Any = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, *, eps_root: float = 0.0,
         moment_requires_grad: bool = False, maximize: bool = False,
         use_accelerated_op: bool = False) -> GradientTransformation:
    """Adam with L2 weight decay, TorchOpt's arithmetic (``use_accelerated_op`` picks
    TorchOpt's fused op, which computes the same here)."""
    b1, b2 = _betas(betas)
    check(lr, weight_decay, eps)
    scaler = scale_by_accelerated_adam if use_accelerated_op else scale_by_adam
    return build((flip_sign_and_add_weight_decay, {"weight_decay": weight_decay,
                                                   "maximize": maximize}),
                 (scaler, {"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root,
                           "moment_requires_grad": moment_requires_grad}),
                 (scale_by_neg_lr, {"lr": lr}))
