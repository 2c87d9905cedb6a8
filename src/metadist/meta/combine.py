"""Composing differentiable optimisers: :func:`chain` and the small transformations most often
chained before or after one (clipping, scaling, schedules, weight decay).

``chain(clip_grad_norm(1.0), adam(1e-3))`` is itself a :class:`Transformation`: its state is
the tuple of its members' states, each member sees the previous one's output as its
"gradients", and all of them see the same ``params``. Like every transformation here, nothing
is modified in place unless ``update(..., inplace=True)`` asks for it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec

from metadist.meta.transforms import (
    Mask,
    PyTree,
    Scalar,
    Transformation,
    _check_scalar,
    _mask_flags,
    _scaled,
)


class EmptyState(NamedTuple):
    """State of a stateless transformation (scaling, clipping, weight decay)."""


class ScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the number of steps taken."""

    steps: int


class _Stateless(Transformation):
    def init(self, params: PyTree) -> EmptyState:
        return EmptyState()

    def _written(self, old: Any, new: Any, spec: TreeSpec) -> Any:
        return new

    def _check(self, state: Any) -> None:
        if not isinstance(state, EmptyState):
            raise TypeError(f"{type(self).__name__.lower()}.update needs the EmptyState from its "
                            f"init, got {type(state).__name__}")


@dataclasses.dataclass(frozen=True, eq=False)
class Chain(Transformation):
    """Several transformations applied in sequence; see :func:`chain`."""

    transformations: tuple[Transformation, ...]

    def __post_init__(self) -> None:
        for t in self.transformations:
            if not isinstance(t, Transformation):
                raise TypeError(f"chain() takes Transformations (sgd(...), clip_grad_norm(...), "
                                f"...), got a {type(t).__name__}")

    def init(self, params: PyTree) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in self.transformations)

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], tuple[Any, ...]]:
        if not isinstance(state, tuple) or len(state) != len(self.transformations):
            raise TypeError(f"chain of {len(self.transformations)} transformations needs the "
                            f"tuple of states from its init, got {type(state).__name__}")
        states = []
        for t, old in zip(self.transformations, state, strict=True):
            grads, new = t._step(grads, params, old, spec)
            states.append(new)
        return grads, tuple(states)

    def _written(self, old: Any, new: Any, spec: TreeSpec) -> tuple[Any, ...]:
        return tuple(t._written(o, n, spec)
                     for t, o, n in zip(self.transformations, old, new, strict=True))


@dataclasses.dataclass(frozen=True, eq=False)
class Scale(_Stateless):
    """Multiply the updates by ``step_size`` (a tensor stays in the graph)."""

    step_size: Scalar

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], EmptyState]:
        self._check(state)
        return [_scaled(g, self.step_size) for g in grads], state


@dataclasses.dataclass(frozen=True, eq=False)
class ScaleBySchedule(Transformation):
    """Multiply the updates by ``schedule(steps)``, ``steps`` the number of earlier updates
    (0 on the first), as a Python int."""

    schedule: Callable[[int], Scalar]

    def init(self, params: PyTree) -> ScheduleState:
        return ScheduleState(0)

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], ScheduleState]:
        if not isinstance(state, ScheduleState):
            raise TypeError("scale_by_schedule.update needs the ScheduleState from its init, "
                            f"got {type(state).__name__}")
        factor = self.schedule(state.steps)
        return [_scaled(g, factor) for g in grads], ScheduleState(state.steps + 1)

    def _written(self, old: Any, new: Any, spec: TreeSpec) -> ScheduleState:
        written: ScheduleState = new
        return written


@dataclasses.dataclass(frozen=True, eq=False)
class ClipGradNorm(_Stateless):
    """Rescale all updates together so that their joint ``norm_type``-norm is at most
    ``max_norm``, with ``torch.nn.utils.clip_grad_norm_``'s arithmetic: factor
    ``min(max_norm / (total_norm + 1e-6), 1)``.

    The factor is a constant for autograd (as in torch and TorchOpt) unless
    ``differentiable_norm=True``, which lets outer gradients flow through the norm too. It is
    kept as a tensor, so clipping never synchronises a GPU (``error_if_nonfinite`` does).
    """

    max_norm: float
    norm_type: float = 2.0
    error_if_nonfinite: bool = False
    differentiable_norm: bool = False

    def __post_init__(self) -> None:
        _check_scalar("max_norm", self.max_norm, 0.0)
        if not (self.norm_type > 0 or math.isinf(self.norm_type)):
            raise ValueError(f"norm_type={self.norm_type!r} is invalid; use a positive p or "
                             "float('inf')")

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], EmptyState]:
        self._check(state)
        if not grads:
            return grads, state
        device = grads[0].device
        with torch.set_grad_enabled(self.differentiable_norm and torch.is_grad_enabled()):
            norms = [torch.linalg.vector_norm(g, self.norm_type).to(device) for g in grads]
            total = torch.linalg.vector_norm(torch.stack(norms), self.norm_type)
            if self.error_if_nonfinite and not bool(total.isfinite()):
                raise RuntimeError(f"the total {self.norm_type}-norm of the updates is "
                                   f"{float(total)}, so they cannot be clipped; fix the loss, "
                                   "or pass error_if_nonfinite=False to scale by it anyway")
            factor = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        return [g * factor.to(g.device) for g in grads], state


@dataclasses.dataclass(frozen=True, eq=False)
class AddDecayedWeights(_Stateless):
    """Add ``weight_decay * param`` to the updates, only where ``mask`` is True (all leaves
    without a mask)."""

    weight_decay: float
    mask: Mask | None = None

    def __post_init__(self) -> None:
        _check_scalar("weight_decay", self.weight_decay, 0.0)

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], EmptyState]:
        self._check(state)
        if self.weight_decay == 0:
            return grads, state
        decayed = self._decay_params(params, self.weight_decay)
        flags = _mask_flags(self.mask, decayed, spec)
        return [g.add(p, alpha=self.weight_decay) if on else g
                for g, p, on in zip(grads, decayed, flags, strict=True)], state


@dataclasses.dataclass(frozen=True, eq=False)
class NanToNum(_Stateless):
    """Replace NaN and infinite updates by finite numbers (``torch.nan_to_num``)."""

    nan: float = 0.0
    posinf: float | None = None
    neginf: float | None = None

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], EmptyState]:
        self._check(state)
        return [g.nan_to_num(self.nan, self.posinf, self.neginf) for g in grads], state


def chain(*transformations: Transformation) -> Chain:
    """Apply ``transformations`` in sequence as one transformation (state: a tuple of their
    states); ``chain()`` is the identity."""
    return Chain(tuple(transformations))


def scale(step_size: Scalar) -> Scale:
    """Multiply the updates by ``step_size`` (e.g. ``-lr`` after a preconditioner)."""
    return Scale(step_size)


def scale_by_schedule(schedule: Callable[[int], Scalar]) -> ScaleBySchedule:
    """Multiply the updates by ``schedule(steps)``, ``steps`` counting from 0."""
    return ScaleBySchedule(schedule)


def clip_grad_norm(max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   *, differentiable_norm: bool = False) -> ClipGradNorm:
    """Clip the joint norm of the updates to ``max_norm`` (``clip_grad_norm_`` arithmetic)."""
    return ClipGradNorm(max_norm, norm_type, error_if_nonfinite, differentiable_norm)


def add_decayed_weights(weight_decay: float, mask: Mask | None = None) -> AddDecayedWeights:
    """Add ``weight_decay * param`` to the updates where ``mask`` (bools shaped like the params,
    or a callable params -> such a tree) is True; needs ``update(..., params=params)``."""
    return AddDecayedWeights(weight_decay, mask)


def nan_to_num(nan: float = 0.0, posinf: float | None = None,
               neginf: float | None = None) -> NanToNum:
    """Replace NaN / +inf / -inf updates by ``nan`` / ``posinf`` / ``neginf``."""
    return NanToNum(nan, posinf, neginf)
