"""TorchOpt's ``torchopt.alias.utils``: the sign flip with L2 weight decay and the scaling by
``-lr`` that every optimiser chain starts and ends with, and the switch between flattened
(``chain.flat``, the default) and tree-shaped chains."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

from torch import Tensor

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.base import EmptyState, GradientTransformation, identity
from metadist.compat.torchopt.combine import chain
from metadist.compat.torchopt.transform import scale, scale_by_schedule
from metadist.compat.torchopt.transform.utils import put, variants

__all__ = ["flip_sign_and_add_weight_decay", "scale_by_neg_lr"]

_lock = threading.Lock()
_use_chain_flat = [True]


def _set_use_chain_flat(use_chain_flat: bool) -> None:
    """Build the optimisers as ``chain.flat`` (True) or as tree-shaped chains (tests)."""
    with _lock:
        _use_chain_flat[0] = use_chain_flat


def _get_use_chain_flat() -> bool:
    with _lock:
        return _use_chain_flat[0]


def _flip_sign_and_add_weight_decay(weight_decay: float = 0.0, maximize: bool = False, *,
                                    already_flattened: bool = False
                                    ) -> GradientTransformation:
    """``updates + weight_decay * params`` (negated first when ``maximize``); ``None``
    updates, of parameters that got no gradient, stay ``None``: their parameters don't move."""
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not maximize and weight_decay == 0.0:
        return identity()
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        if weight_decay == 0.0:
            return tree_map(lambda g: put(g, g.neg(), inplace), updates), state
        if params is None:
            raise AssertionError("Parameters are required for weight decay. Call "
                                 "`update(updates, state, params=params)` instead.")

        def f(p: Tensor, g: Tensor | None) -> Tensor | None:
            if g is None:
                return None
            start = g.neg() if maximize else g
            p = p if g.requires_grad or not inplace else p.detach()
            return put(g, start.add(p, alpha=weight_decay), inplace)

        return tree_map(f, params, updates), state

    return GradientTransformation(init, update)


def _scale_by_neg_lr(lr: Any, *, already_flattened: bool = False) -> GradientTransformation:
    """Scale by ``-lr`` (``lr`` a number or a schedule of the step count)."""
    if not (callable(lr) or lr >= 0.0):
        raise ValueError(f"Invalid learning rate: {lr}")
    if callable(lr) and not isinstance(lr, Tensor):
        schedule: Callable[[Any], Any] = lr
        return cast(GradientTransformation, scale_by_schedule.impl(
            lambda count: -schedule(count), already_flattened=already_flattened))
    return cast(GradientTransformation, scale.impl(-lr, already_flattened=already_flattened))


flip_sign_and_add_weight_decay = variants(_flip_sign_and_add_weight_decay)
scale_by_neg_lr = variants(_scale_by_neg_lr)


def build(*parts: tuple[Callable[..., GradientTransformation], dict[str, Any]]
          ) -> GradientTransformation:
    """The chain of ``fn(**kwargs)`` for each part: of their flat variants in a
    ``chain.flat`` when :func:`_get_use_chain_flat`, else tree-shaped."""
    if _get_use_chain_flat():
        flat: GradientTransformation = chain.flat(  # type: ignore[attr-defined]
            *(fn.flat(**kw) for fn, kw in parts))  # type: ignore[attr-defined]
        return flat
    return chain(*(fn(**kw) for fn, kw in parts))


def check(lr: Any, weight_decay: float = 0.0, eps: float = 0.0) -> None:
    if not (callable(lr) or lr >= 0.0):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
