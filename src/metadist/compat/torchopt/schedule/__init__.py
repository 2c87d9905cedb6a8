"""TorchOpt's learning-rate schedules: functions of the step count."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["exponential_decay", "linear_schedule", "polynomial_schedule"]

Schedule = Callable[[Any], Any]


def exponential_decay(init_value: Any, decay_rate: Any, transition_begin: int = 0,
                      transition_steps: int = 1, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)``
    (floored exponent with ``staircase``), clipped at ``end_value``."""
    if transition_steps is not None and transition_steps <= 0:
        logging.info("An exponential schedule was set with a non-positive `transition_steps` "
                     "value; this will result in a constant schedule with value `init_value`.")
        return lambda count: init_value
    if decay_rate == 0:
        logging.info("An exponential schedule was set with a zero `decay_rate` value; this "
                     "will result in a constant schedule with value `init_value`.")
        return lambda count: init_value
    if transition_begin < 0:
        logging.info("An exponential schedule was set with a negative `transition_begin` "
                     "value; this will result in `transition_begin` falling back to `0`.")
        transition_begin = 0
    clip = max if decay_rate < 1.0 else min

    def schedule(count: Any) -> Any:
        elapsed = count - transition_begin
        power = elapsed / transition_steps
        if staircase:
            power = math.floor(power)
        value = init_value if elapsed <= 0.0 else init_value * decay_rate**power
        return value if end_value is None else clip(value, end_value)

    return schedule


def polynomial_schedule(init_value: Any, end_value: Any, power: Any, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` over ``transition_steps`` steps after
    ``transition_begin``, as ``(init - end) * (1 - t / steps) ** power + end``."""
    if transition_steps <= 0:
        logging.info("A polynomial schedule was set with a non-positive `transition_steps` "
                     "value; this results in a constant schedule with value `init_value`.")
        return lambda count: init_value
    if transition_begin < 0:
        logging.info("An exponential schedule was set with a negative `transition_begin` "
                     "value; this will result in `transition_begin` falling back to `0`.")
        transition_begin = 0

    def schedule(count: Any) -> Any:
        clip = torch.clamp if isinstance(count, torch.Tensor) else np.clip
        done = clip(count - transition_begin, 0, transition_steps)
        return (init_value - end_value) * (1.0 - done / transition_steps) ** power + end_value

    return schedule


def linear_schedule(init_value: Any, end_value: Any, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """:func:`polynomial_schedule` of power 1."""
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)
