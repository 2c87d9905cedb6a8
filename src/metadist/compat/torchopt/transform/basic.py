"""TorchOpt's stateless transformations and momentum: ``scale``, ``scale_by_schedule``,
``add_decayed_weights``, ``masked``, ``trace``, ``nan_to_num`` (TorchOpt's arithmetic and
order of operations, so results agree to the last bit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt._tree import MaskedNode
from metadist.compat.torchopt.base import EmptyState, GradientTransformation, identity
from metadist.compat.torchopt.transform.utils import inc_count, put, variants

__all__ = ["AddDecayedWeightsState", "MaskedNode", "MaskedState", "ScaleByScheduleState",
           "ScaleState", "TraceState", "add_decayed_weights", "masked", "nan_to_num", "scale",
           "scale_by_schedule", "trace"]

ScaleState = EmptyState
AddDecayedWeightsState = EmptyState


class ScaleByScheduleState(NamedTuple):
    count: Any


class MaskedState(NamedTuple):
    inner_state: Any


class TraceState(NamedTuple):
    trace: Any


def _empty(params: Any) -> EmptyState:
    return EmptyState()


def _scale(step_size: float, *, already_flattened: bool = False) -> GradientTransformation:
    """Multiply the updates by ``step_size``."""
    tree_map = _tree.mappers(already_flattened)[0]

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        return tree_map(lambda g: put(g, g.mul(step_size), inplace), updates), state

    return GradientTransformation(_empty, update)


def _scale_by_schedule(step_size_fn: Callable[[Any], Any], *,
                       already_flattened: bool = False) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)`` (a count per leaf, from 0)."""
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(tree_map(_zero_count, params))

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        def f(c: Tensor, g: Tensor | None) -> Tensor | None:
            return None if g is None else put(g, g.mul(step_size_fn(c)), inplace)

        updates = tree_map(f, state.count, updates)
        count = inc_count.impl(updates, state.count, already_flattened=already_flattened)
        return updates, ScaleByScheduleState(count)

    return GradientTransformation(init, update)


def _zero_count(t: Tensor) -> Tensor:
    return torch.zeros(1, dtype=torch.int64, device=t.device).squeeze_()


def _decay(weight_decay: float, inplace: bool) -> Callable[[Tensor, Tensor | None], Any]:
    def f(p: Tensor, g: Tensor | None) -> Tensor | None:
        if g is None:
            return None
        if inplace:  # an update outside autograd stays outside (TorchOpt adds p.data)
            return g.copy_(g.add(p if g.requires_grad else p.detach(), alpha=weight_decay))
        return g.add(p, alpha=weight_decay)
    return f


def _masked(inner: GradientTransformation, mask: Any = None, *,
            already_flattened: bool = False) -> GradientTransformation:
    """``inner`` on the leaves ``mask`` (a tree of bools, or params -> one) marks True; the
    others pass through unchanged."""
    tree_map = _tree.mappers(already_flattened)[0]

    def hide(tree: Any, mask_tree: Any) -> Any:
        return tree_map(lambda x, m: x if m else MaskedNode(), tree, mask_tree)

    def init(params: Any) -> MaskedState:
        mask_tree = mask(params) if callable(mask) else mask
        return MaskedState(inner.init(hide(params, mask_tree)))

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        mask_tree = mask(updates) if callable(mask) else mask
        new, inner_state = inner.update(hide(updates, mask_tree), state.inner_state,
                                        params=None if params is None else hide(params,
                                                                                mask_tree),
                                        inplace=inplace)
        merged = tree_map(lambda old, n, m: n if m else old, updates, new, mask_tree)
        return merged, MaskedState(inner_state)

    return GradientTransformation(init, update)


def _add_decayed_weights(weight_decay: float = 0.0, mask: Any = None, *,
                         already_flattened: bool = False) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (only where ``mask`` says, if given)."""
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if weight_decay == 0.0 and mask is None:
        return identity()
    tree_map = _tree.mappers(already_flattened)[0]

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        if params is None:
            raise AssertionError("Parameters are required for weight decay. Call "
                                 "`update(updates, state, params=params)` instead.")
        return tree_map(_decay(weight_decay, inplace), params, updates), state

    plain = GradientTransformation(_empty, update)
    if mask is not None:
        return _masked(plain, mask, already_flattened=already_flattened)
    return plain


def _trace(momentum: float = 0.9, dampening: float = 0.0, nesterov: bool = False,
           moment_requires_grad: bool = False, *,
           already_flattened: bool = False) -> GradientTransformation:
    """Momentum as torch.optim.SGD's: the first update seeds the trace (TorchOpt tracks that
    first call in the transformation itself, not in its state)."""
    if not momentum >= 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if momentum == 0.0:
        return identity()
    tree_map = _tree.mappers(already_flattened)[0]
    first = [True]

    def init(params: Any) -> TraceState:
        return TraceState(tree_map(
            lambda t: torch.zeros_like(t, requires_grad=moment_requires_grad), params))

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        keep = 1.0 if nesterov else 1.0 - dampening

        def step(t: Tensor, g: Tensor | None) -> Tensor | None:
            if g is None:
                return None
            new = t.add(g) if first[0] else t.mul(momentum).add_(g, alpha=keep)
            return put(t, new, inplace)

        trace = tree_map(step, state.trace, updates)
        if nesterov:
            out = tree_map(lambda t, g: None if g is None else
                           put(g, g.add(t, alpha=momentum), inplace), trace, updates)
        else:
            out = tree_map(lambda t, g: None if g is None else
                           (g.copy_(t) if inplace else t.clone()), trace, updates)
        first[0] = False
        return out, TraceState(trace)

    return GradientTransformation(init, update)


def nan_to_num(nan: float = 0.0, posinf: float | None = None, neginf: float | None = None
               ) -> GradientTransformation:
    """Replace NaN and infinities in the updates (``None`` state accepted)."""
    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        def f(g: Tensor) -> Tensor:
            return put(g, g.nan_to_num(nan=nan, posinf=posinf, neginf=neginf), inplace)
        return _tree.tree_map(f, updates), state

    return GradientTransformation(_empty, update)


scale = variants(_scale)
scale_by_schedule = variants(_scale_by_schedule)
masked = variants(_masked)
add_decayed_weights = variants(_add_decayed_weights)
trace = variants(_trace)
