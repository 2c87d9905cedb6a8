"""TorchOpt's functional optimisers (``torchopt.sgd``, ``adam``, ... and ``chain``) with
TorchOpt's signatures, positional order and defaults, computed by metadist's differentiable
transformations (:mod:`metadist.meta`).

A :class:`GradientTransformation` has TorchOpt's ``init(params)`` and
``update(updates, state, *, params=None, inplace=True)``. ``lr`` may be a schedule (a function
of the step count, called with an integer tensor from 0, as TorchOpt does). Differences kept
on purpose, each documented in docs/mapreduce.md ("Coming from TorchOpt"): updates are always
computed out of place (``inplace=True`` gives the same values and never mutates the caller's
gradient tensors); a ``None`` gradient is a zero gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from metadist import meta
from metadist.meta import combine
from metadist.meta.transforms import Transformation

Schedule = Callable[[Tensor], Any]


class GradientTransformation:
    """TorchOpt's ``(init, update)`` pair over one of metadist's transformations."""

    def __init__(self, native: Transformation | _Chain, schedule: Schedule | None = None
                 ) -> None:
        self.native, self.schedule = native, schedule

    def init(self, params: Any) -> Any:
        return self.native.init(params)

    def update(self, updates: Any, state: Any, *, params: Any = None,
               inplace: bool = True) -> tuple[Any, Any]:
        native = self.native
        if self.schedule is not None:
            lr = self.schedule(torch.tensor(int(getattr(state, "steps", 0))))
            native = dataclasses.replace(native, lr=lr)  # type: ignore[type-var]
        return native.update(_dense(updates, params), state, params=params)

    def __repr__(self) -> str:
        return f"GradientTransformation({self.native!r})"


def _dense(updates: Any, params: Any) -> Any:
    """``None`` gradients (``allow_unused=True``) as zeros shaped like their parameters."""
    leaves, spec = tree_flatten(updates, is_leaf=lambda x: x is None)
    if all(u is not None for u in leaves):
        return updates
    if params is None:
        raise ValueError("update() got None gradients: pass params=... so they can be read "
                         "as zeros of the parameters' shapes")
    refs, _ = tree_flatten(params)
    return tree_unflatten([torch.zeros_like(p) if u is None else u
                           for u, p in zip(leaves, refs, strict=True)], spec)


def _build(make: Callable[..., Transformation], lr: Any, **kwargs: Any
           ) -> GradientTransformation:
    if callable(lr) and not isinstance(lr, Tensor):
        return GradientTransformation(make(lr=float(lr(torch.tensor(0))), **kwargs), lr)
    return GradientTransformation(make(lr=lr, **kwargs))


def sgd(lr: Any, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, *, moment_requires_grad: bool = False,
        maximize: bool = False) -> GradientTransformation:
    """TorchOpt's ``sgd`` (its 4th positional argument is ``weight_decay``, torch's order).
    ``moment_requires_grad`` changes nothing: SGD's first momentum is the gradient itself."""
    return _build(meta.sgd, lr, momentum=momentum, dampening=dampening,
                  weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)


def adam(lr: Any = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, *, eps_root: float = 0.0,
         moment_requires_grad: bool = False, maximize: bool = False,
         use_accelerated_op: bool = False) -> GradientTransformation:
    """TorchOpt's ``adam``; ``use_accelerated_op`` selects TorchOpt's fused kernel there and
    changes nothing here (the same arithmetic)."""
    return _build(meta.adam, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                  maximize=maximize, eps_root=eps_root,
                  moment_requires_grad=moment_requires_grad)


def adamw(lr: Any = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, *, eps_root: float = 0.0, mask: Any = None,
          moment_requires_grad: bool = False, maximize: bool = False,
          use_accelerated_op: bool = False) -> GradientTransformation:
    """TorchOpt's ``adamw`` (``mask``: where decay applies, a tree of bools or a function)."""
    return _build(meta.adamw, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                  maximize=maximize, eps_root=eps_root,
                  moment_requires_grad=moment_requires_grad, mask=mask)


def rmsprop(lr: Any = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
            momentum: float = 0.0, centered: bool = False, *, initial_scale: float = 0.0,
            nesterov: bool = False, maximize: bool = False) -> GradientTransformation:
    """TorchOpt's ``rmsprop``."""
    return _build(meta.rmsprop, lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                  momentum=momentum, centered=centered, maximize=maximize,
                  initial_scale=initial_scale, nesterov=nesterov)


def adagrad(lr: Any = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
            initial_accumulator_value: float = 0.0, eps: float = 1e-10, *,
            maximize: bool = False) -> GradientTransformation:
    """TorchOpt's ``adagrad``."""
    return _build(meta.adagrad, lr, lr_decay=lr_decay, weight_decay=weight_decay,
                  initial_accumulator_value=initial_accumulator_value, eps=eps,
                  maximize=maximize)


def adadelta(lr: Any = 1e-3, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
             *, moment_requires_grad: bool = False) -> GradientTransformation:
    """TorchOpt's ``adadelta`` (its default lr is 1e-3, torch's 1.0)."""
    return _build(meta.adadelta, lr, rho=rho, eps=eps, weight_decay=weight_decay,
                  moment_requires_grad=moment_requires_grad)


def adamax(lr: Any = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
           weight_decay: float = 0.0, *, moment_requires_grad: bool = False
           ) -> GradientTransformation:
    """TorchOpt's ``adamax`` (defaults lr 1e-3, eps 1e-6; torch's are 2e-3, 1e-8)."""
    return _build(meta.adamax, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                  moment_requires_grad=moment_requires_grad)


def radam(lr: Any = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
          weight_decay: float = 0.0, *, moment_requires_grad: bool = False
          ) -> GradientTransformation:
    """TorchOpt's ``radam`` (default eps 1e-6; torch's is 1e-8)."""
    return _build(meta.radam, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                  moment_requires_grad=moment_requires_grad)


def clip_grad_norm(max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> GradientTransformation:
    """TorchOpt's ``clip_grad_norm`` transformation (chain it before an optimiser)."""
    return GradientTransformation(combine.clip_grad_norm(max_norm, norm_type,
                                                         error_if_nonfinite))


def nan_to_num(nan: float = 0.0, posinf: float | None = None, neginf: float | None = None
               ) -> GradientTransformation:
    """TorchOpt's ``nan_to_num`` transformation."""
    return GradientTransformation(combine.nan_to_num(nan, posinf, neginf))


class _Chain:
    """The members in sequence, each with its own schedule (state: their states' tuple)."""

    def __init__(self, members: tuple[GradientTransformation, ...]) -> None:
        self.members = members

    def init(self, params: Any) -> Any:
        return tuple(m.init(params) for m in self.members)

    def update(self, grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        new = []
        for member, old in zip(self.members, state, strict=True):
            grads, fresh = member.update(grads, old, params=params)
            new.append(fresh)
        return grads, tuple(new)


def chain(*transformations: GradientTransformation) -> GradientTransformation:
    """TorchOpt's ``chain``: apply ``transformations`` in order."""
    for t in transformations:
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain() takes TorchOpt-style transformations (torchopt.sgd(...), "
                            f"clip_grad_norm(...)); got {type(t).__name__}")
    return GradientTransformation(_Chain(transformations))
