"""TorchOpt's ``adamax``."""

from __future__ import annotations

from typing import Any

from metadist.compat.torchopt.alias.utils import (
    build,
    check,
    flip_sign_and_add_weight_decay,
    scale_by_neg_lr,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform import scale_by_adamax

__all__ = ["adamax"]


def adamax(lr: Any = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
          weight_decay: float = 0.0, *, moment_requires_grad: bool = False
          ) -> GradientTransformation:
    """AdaMax with L2 weight decay."""
    b1, b2 = betas
    for b in (b1, b2):
        if not 0 <= b <= 1:
            raise ValueError(f"Invalid rho value: {b}")
    check(lr, weight_decay, eps)
    return build((flip_sign_and_add_weight_decay, {"weight_decay": weight_decay,
                                                   "maximize": False}),
                 (scale_by_adamax, {"b1": b1, "b2": b2, "eps": eps,
                           "moment_requires_grad": moment_requires_grad}),
                 (scale_by_neg_lr, {"lr": lr}))
