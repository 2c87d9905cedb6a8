"""TorchOpt's ``adamw``."""

from __future__ import annotations

from typing import Any

from metadist.compat.torchopt.alias.adam import _betas
from metadist.compat.torchopt.alias.utils import (
    build,
    check,
    flip_sign_and_add_weight_decay,
    scale_by_neg_lr,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform import (
    add_decayed_weights,
    scale_by_accelerated_adam,
    scale_by_adam,
)

__all__ = ["adamw"]


def adamw(lr: Any = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, *, eps_root: float = 0.0, mask: Any = None,
          moment_requires_grad: bool = False, maximize: bool = False,
          use_accelerated_op: bool = False) -> GradientTransformation:
    """Adam with decoupled weight decay (``mask``: where it applies, a tree of bools or
    params -> one)."""
    b1, b2 = _betas(betas)
    check(lr, weight_decay, eps)
    scaler = scale_by_accelerated_adam if use_accelerated_op else scale_by_adam
    return build((flip_sign_and_add_weight_decay, {"weight_decay": 0.0, "maximize": maximize}),
                 (scaler, {"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root,
                           "moment_requires_grad": moment_requires_grad}),
                 (add_decayed_weights, {"weight_decay": weight_decay, "mask": mask}),
                 (scale_by_neg_lr, {"lr": lr}))
