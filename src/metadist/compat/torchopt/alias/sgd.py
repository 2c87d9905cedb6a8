"""TorchOpt's ``sgd``."""

from __future__ import annotations

from typing import Any

from metadist.compat.torchopt.alias.utils import (
    build,
    check,
    flip_sign_and_add_weight_decay,
    scale_by_neg_lr,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform import trace

__all__ = ["sgd"]


def sgd(lr: Any, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, *, moment_requires_grad: bool = False,
        maximize: bool = False) -> GradientTransformation:
    """SGD with momentum (torch.optim's seeding: the first gradient is the first trace),
    dampening, Nesterov and L2 weight decay."""
    check(lr, weight_decay)
    if not momentum >= 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    return build((flip_sign_and_add_weight_decay, {"weight_decay": weight_decay,
                                                   "maximize": maximize}),
                 (trace, {"momentum": momentum, "dampening": dampening, "nesterov": nesterov,
                          "moment_requires_grad": moment_requires_grad}),
                 (scale_by_neg_lr, {"lr": lr}))
