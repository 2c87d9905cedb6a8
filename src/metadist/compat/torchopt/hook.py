"""TorchOpt's gradient hooks: ``zero_nan_hook``, ``nan_to_num_hook`` and ``register_hook``
(a transformation that registers a hook on every update tensor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.base import EmptyState, GradientTransformation

__all__ = ["nan_to_num_hook", "register_hook", "zero_nan_hook"]


def zero_nan_hook(g: Tensor) -> Tensor:
    """NaN -> 0."""
    return g.nan_to_num(nan=0.0)


def nan_to_num_hook(nan: float = 0.0, posinf: float | None = None,
                    neginf: float | None = None) -> Callable[[Tensor], Tensor]:
    """A hook that replaces NaN and infinities."""
    def hook(g: Tensor) -> Tensor:
        return g.nan_to_num(nan=nan, posinf=posinf, neginf=neginf)
    return hook


def register_hook(hook: Callable[[Tensor], Tensor | None]) -> GradientTransformation:
    """Register ``hook`` on each update (it runs on their gradients in a later backward)."""
    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        _tree.tree_map_(lambda g: g.register_hook(hook), updates)
        return updates, state

    return GradientTransformation(init, update)
