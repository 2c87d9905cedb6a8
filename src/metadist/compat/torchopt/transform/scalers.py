"""TorchOpt's adaptive scalers: ``scale_by_adam`` (and ``scale_by_accelerated_adam``, the same
arithmetic here: TorchOpt's pure-Python path), ``scale_by_rms``, ``scale_by_stddev``,
``scale_by_rss``, ``scale_by_adamax``, ``scale_by_adadelta``, ``scale_by_radam``.

TorchOpt's arithmetic, not torch.optim's: Adam keeps a step count per leaf as an int64 tensor
and divides each moment by its bias correction (computed in the moment's dtype) before
``sqrt(nu_hat + eps_root) + eps``; the drop-in gives TorchOpt's numbers, where metadist's own
optimisers (:mod:`metadist.meta`) follow torch.optim's.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.accelerated_op.adam_op import AdamOp
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.transform.basic import _zero_count
from metadist.compat.torchopt.transform.utils import inc_count, put, update_moment, variants

__all__ = [
    "ScaleByAdadeltaState",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByRAdamState",
    "ScaleByRStdDevState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "scale_by_accelerated_adam",
    "scale_by_adadelta",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_stddev",
]


class ScaleByAdamState(NamedTuple):
    mu: Any
    nu: Any
    count: Any


class ScaleByRmsState(NamedTuple):
    nu: Any


class ScaleByRStdDevState(NamedTuple):
    mu: Any
    nu: Any


class ScaleByRssState(NamedTuple):
    sum_of_squares: Any


class ScaleByAdamaxState(NamedTuple):
    mu: Any
    nu: Any
    t: int


class ScaleByAdadeltaState(NamedTuple):
    mu: Any
    nu: Any


class ScaleByRAdamState(NamedTuple):
    mu: Any
    nu: Any
    t: int


def _check(eps: float, name: str = "", *betas: float) -> None:
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid {name} parameter at index {i}: {b}")


def _zeros(requires_grad: bool) -> Any:
    return lambda t: torch.zeros_like(t, requires_grad=requires_grad)


def _moment(updates: Any, moments: Any, decay: float, order: int, inplace: bool,
            flat: bool) -> Any:
    return update_moment.impl(updates, moments, decay, order=order, inplace=inplace,
                              already_flattened=flat)


def _adam_init(moment_requires_grad: bool, tree_map: Any) -> Any:
    """Adam's state for ``params``: zero moments and a zero count per tensor."""
    def init(params: Any) -> ScaleByAdamState:
        zeros = _zeros(moment_requires_grad)
        return ScaleByAdamState(tree_map(zeros, params), tree_map(zeros, params),
                                tree_map(_zero_count, params))
    return init


def _scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   eps_root: float = 0.0, moment_requires_grad: bool = False, *,
                   already_flattened: bool = False) -> GradientTransformation:
    """Adam's scaling: ``mu_hat / (sqrt(nu_hat + eps_root) + eps)``."""
    _check(eps, "beta", b1, b2)
    tree_map = _tree.mappers(already_flattened)[0]

    init = _adam_init(moment_requires_grad, tree_map)

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        mu = _moment(updates, state.mu, b1, 1, inplace, already_flattened)
        nu = _moment(updates, state.nu, b2, 2, inplace, already_flattened)
        count = inc_count.impl(updates, state.count, already_flattened=already_flattened)
        mu_hat = tree_map(lambda m, c: m.div(1 - pow(b1, c)), mu, count)
        nu_hat = tree_map(lambda v, c: v.div(1 - pow(b2, c)), nu, count)

        def f(m: Tensor, v: Tensor, g: Tensor | None) -> Tensor | None:
            return None if g is None else m.div(v.add(eps_root).sqrt_().add(eps))

        return tree_map(f, mu_hat, nu_hat, updates), ScaleByAdamState(mu, nu, count)

    return GradientTransformation(init, update)


def _scale_by_accelerated_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                               eps_root: float = 0.0, moment_requires_grad: bool = False, *,
                               already_flattened: bool = False) -> GradientTransformation:
    """TorchOpt's fused Adam: :class:`~metadist.compat.torchopt.accelerated_op.AdamOp` per
    tensor, with TorchOpt's backward (its numbers; ``scale_by_adam`` has the exact
    derivative)."""
    _check(eps, "beta", b1, b2)
    tree_map = _tree.mappers(already_flattened)[0]

    init = _adam_init(moment_requires_grad, tree_map)

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        count = inc_count.impl(updates, state.count, already_flattened=already_flattened)
        op = AdamOp(b1=b1, b2=b2, eps=eps, eps_root=eps_root, inplace=inplace)

        def step(mu: Any, nu: Any, g: Any, c: Any) -> tuple[Any, Any, Any]:
            if mu is None or isinstance(mu, _tree.MaskedNode):
                return mu, nu, g
            return op(mu, nu, g, c)

        if already_flattened:
            out = [step(*leaf) for leaf in zip(state.mu, state.nu, updates, count, strict=True)]
            like = updates.__class__
            mu, nu, new = (like([o[i] for o in out]) for i in range(3))
        else:
            mus, spec = _tree.flatten(state.mu)
            out = [step(*leaf) for leaf in zip(mus, _tree.leaves(state.nu, none_is_leaf=True),
                                                 spec.flatten_up_to(updates),
                                                 _tree.leaves(count, none_is_leaf=True),
                                                 strict=True)]
            mu, nu, new = (_tree.unflatten(spec, [o[i] for o in out]) for i in range(3))
        return new, ScaleByAdamState(mu, nu, count)

    return GradientTransformation(init, update)


def _scale_by_rms(alpha: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0, *,
                  already_flattened: bool = False) -> GradientTransformation:
    """RMSProp's scaling: ``g / (sqrt(nu) + eps)``."""
    if not alpha >= 0.0:
        raise ValueError(f"Invalid alpha value: {alpha}")
    _check(eps)
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> ScaleByRmsState:
        return ScaleByRmsState(tree_map(lambda t: torch.full_like(t, initial_scale), params))

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        nu = _moment(updates, state.nu, alpha, 2, inplace, already_flattened)
        out = tree_map(lambda n, g: None if g is None else
                       put(g, g.div(n.sqrt().add(eps)), inplace), nu, updates)
        return out, ScaleByRmsState(nu)

    return GradientTransformation(init, update)


def _scale_by_stddev(alpha: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0, *,
                     already_flattened: bool = False) -> GradientTransformation:
    """Centred RMSProp's scaling: ``g / (sqrt(nu - mu**2) + eps)``."""
    if not alpha >= 0.0:
        raise ValueError(f"Invalid alpha value: {alpha}")
    _check(eps)
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> ScaleByRStdDevState:
        return ScaleByRStdDevState(tree_map(torch.zeros_like, params),
                                   tree_map(lambda t: torch.full_like(t, initial_scale), params))

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        mu = _moment(updates, state.mu, alpha, 1, inplace, already_flattened)
        nu = _moment(updates, state.nu, alpha, 2, inplace, already_flattened)

        def f(m: Tensor, n: Tensor, g: Tensor | None) -> Tensor | None:
            if g is None:
                return None
            return put(g, g.div(n.addcmul(m, m, value=-1.0).sqrt_().add(eps)), inplace)

        return tree_map(f, mu, nu, updates), ScaleByRStdDevState(mu, nu)

    return GradientTransformation(init, update)


def _scale_by_rss(initial_accumulator_value: float = 0.0, eps: float = 1e-10, *,
                  already_flattened: bool = False) -> GradientTransformation:
    """AdaGrad's scaling by the root of the sum of squared updates (0 where that is 0)."""
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> ScaleByRssState:
        return ScaleByRssState(tree_map(
            lambda t: torch.full_like(t, initial_accumulator_value,
                                      memory_format=torch.preserve_format), params))

    def update(updates: Any, state: Any, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        sos = _moment(updates, state.sum_of_squares, 1.0, 2, inplace, already_flattened)

        def f(s: Tensor, g: Tensor | None) -> Tensor | None:
            if g is None:
                return None
            scaled = put(g, g.div(s.sqrt().add(eps)), inplace)
            return torch.where(s > 0.0, scaled, 0.0)

        return tree_map(f, sos, updates), ScaleByRssState(sos)

    return GradientTransformation(init, update)


def _scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                     moment_requires_grad: bool = False, *,
                     already_flattened: bool = False) -> GradientTransformation:
    """AdaMax: ``mu / max(b2 * nu, |g| + eps) / (1 - b1**t)``."""
    _check(eps, "b1", b1, b2)
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> ScaleByAdamaxState:
        zeros = _zeros(moment_requires_grad)
        return ScaleByAdamaxState(tree_map(zeros, params), tree_map(zeros, params), 1)

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        mu = _moment(updates, state.mu, b1, 1, inplace, already_flattened)
        nu = tree_map(lambda n, g: None if g is None else torch.max(n.mul(b2),
                                                                   g.abs().add_(eps)),
                      state.nu, updates)
        bias = 1 - b1**state.t
        out = tree_map(lambda m, n: m if n is None else m.div(n).div_(bias), mu, nu)
        return out, ScaleByAdamaxState(mu, nu, state.t + 1)

    return GradientTransformation(init, update)


def _scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6, moment_requires_grad: bool = False,
                       *, already_flattened: bool = False) -> GradientTransformation:
    """AdaDelta: ``g * sqrt((delta + eps) / (square_avg + eps))``."""
    _check(eps, "rho", rho)
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> ScaleByAdadeltaState:
        zeros = _zeros(moment_requires_grad)
        return ScaleByAdadeltaState(tree_map(zeros, params), tree_map(zeros, params))

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        mu = _moment(updates, state.mu, rho, 2, inplace, already_flattened)

        def f(m: Tensor, v: Tensor, g: Tensor | None) -> Tensor | None:
            if g is None:
                return None
            return put(g, g.mul(v.add(eps).div_(m.add(eps)).sqrt_()), inplace)

        updates = tree_map(f, mu, state.nu, updates)
        nu = _moment(updates, state.nu, rho, 2, inplace, already_flattened)
        return updates, ScaleByAdadeltaState(mu, nu)

    return GradientTransformation(init, update)


def _scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                    moment_requires_grad: bool = False, *,
                    already_flattened: bool = False) -> GradientTransformation:
    """RAdam: the rectified adaptive step once the variance is tractable (rho > 5), the
    bias-corrected momentum before."""
    _check(eps, "b1", b1, b2)
    tree_map = _tree.mappers(already_flattened)[0]

    def init(params: Any) -> ScaleByRAdamState:
        zeros = _zeros(moment_requires_grad)
        return ScaleByRAdamState(tree_map(zeros, params), tree_map(zeros, params), 1)

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        mu = _moment(updates, state.mu, b1, 1, inplace, already_flattened)
        nu = _moment(updates, state.nu, b2, 2, inplace, already_flattened)
        t = state.t
        rho_inf = 2 / (1 - b2) - 1
        bias1, bias2 = 1 - b1**t, 1 - b2**t
        rho = rho_inf - 2 * t * b2**t / bias2
        if rho > 5:
            r = math.sqrt(bias2 * (rho - 4) * (rho - 2) * rho_inf
                          / ((rho_inf - 4) * (rho_inf - 2) * rho))
            out = tree_map(lambda m, v: m.mul(r / bias1).div(v.sqrt().add(eps)), mu, nu)
        else:
            out = tree_map(lambda m, v: m.div(bias1), mu, nu)
        return out, ScaleByRAdamState(mu, nu, t + 1)

    return GradientTransformation(init, update)


scale_by_adam = variants(_scale_by_adam)
scale_by_accelerated_adam = variants(_scale_by_accelerated_adam)
scale_by_rms = variants(_scale_by_rms)
scale_by_stddev = variants(_scale_by_stddev)
scale_by_rss = variants(_scale_by_rss)
scale_by_adamax = variants(_scale_by_adamax)
scale_by_adadelta = variants(_scale_by_adadelta)
scale_by_radam = variants(_scale_by_radam)
