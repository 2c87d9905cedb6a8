"""TorchOpt's ``adagrad``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from metadist.compat.torchopt.alias.utils import (
    build,
    check,
    flip_sign_and_add_weight_decay,
    scale_by_neg_lr,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform import scale_by_rss, scale_by_schedule

__all__ = ["adagrad"]


def _adagrad_lr_schedule(decay_rate: Any, transition_begin: int = 0) -> Callable[[Any], Any]:
    """``1 / (1 + decay_rate * (count - transition_begin))``."""
    if transition_begin < 0:
        logging.info("The AdaGrad learning rate schedule was set with a negative "
                     "`transition_begin` value; this will result in `transition_begin` "
                     "falling back to `0`.")
        transition_begin = 0

    def schedule(count: Any) -> Any:
        return 1 / (1 + decay_rate * (count - transition_begin))

    return schedule


def adagrad(lr: Any = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
            initial_accumulator_value: float = 0.0, eps: float = 1e-10, *,
            maximize: bool = False) -> GradientTransformation:
    """AdaGrad with torch.optim's learning-rate decay."""
    check(lr, weight_decay, eps)
    if not lr_decay >= 0.0:
        raise ValueError(f"Invalid lr_decay value: {lr_decay}")
    if not initial_accumulator_value >= 0.0:
        raise ValueError(f"Invalid initial_accumulator_value value: "
                         f"{initial_accumulator_value}")
    return build((flip_sign_and_add_weight_decay, {"weight_decay": weight_decay,
                                                   "maximize": maximize}),
                 (scale_by_rss, {"initial_accumulator_value": initial_accumulator_value,
                                 "eps": eps}),
                 (scale_by_schedule, {"step_size_fn": _adagrad_lr_schedule(lr_decay)}),
                 (scale_by_neg_lr, {"lr": lr}))
