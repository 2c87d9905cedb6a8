"""TorchOpt's ``rmsprop``."""

from __future__ import annotations

from typing import Any

from metadist.compat.torchopt.alias.utils import (
    build,
    check,
    flip_sign_and_add_weight_decay,
    scale_by_neg_lr,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform import scale_by_rms, scale_by_stddev, trace

__all__ = ["rmsprop"]


def rmsprop(lr: Any = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
            momentum: float = 0.0, centered: bool = False, *, initial_scale: float = 0.0,
            nesterov: bool = False, maximize: bool = False) -> GradientTransformation:
    """RMSProp (``centered``: by the running standard deviation), then momentum."""
    check(lr, weight_decay, eps)
    if not alpha >= 0.0:
        raise ValueError(f"Invalid alpha value: {alpha}")
    if not momentum >= 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    return build((flip_sign_and_add_weight_decay, {"weight_decay": weight_decay,
                                                   "maximize": maximize}),
                 (scale_by_stddev if centered else scale_by_rms,
                  {"alpha": alpha, "eps": eps, "initial_scale": initial_scale}),
                 (trace, {"momentum": momentum, "nesterov": nesterov}),
                 (scale_by_neg_lr, {"lr": lr}))
