"""Differentiable optimisers as pure transformations of parameter pytrees.

``transform.init(params) -> state`` and ``transform.update(grads, state, params=...) ->
(updates, new_state)``, then ``apply_updates(params, updates)``. Nothing is modified in place
(unless asked), so every update, and the optimiser state (momentum buffers, Adam moments), is
part of the autograd graph: an outer backward flows through all inner steps, through the
state, and into tensor hyperparameters such as a learnable learning rate.

The arithmetic follows ``torch.optim`` (SGD, Adam, AdamW with default flags) operation by
operation, so with detached gradients the iterates agree with torch's to rounding.

Params, grads and states are pytrees (dicts, tuples, lists, nested) of tensors; grads must have
the structure of the params. States are NamedTuples whose tensor fields mirror that structure
and whose step counter ``steps`` is a plain int (bias corrections are then exact Python floats,
as in torch, and reading the counter never synchronises a GPU).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

PyTree = Any
Scalar = float | Tensor  # learning rates may be tensors (learnable, part of the graph)


class SGDState(NamedTuple):
    """State of :func:`sgd`: steps taken and momentum buffers (``None`` without momentum)."""

    steps: int
    momentum: PyTree | None


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`: steps taken, first and second moments."""

    steps: int
    mu: PyTree
    nu: PyTree


def _flat(tree: PyTree, what: str, spec: TreeSpec | None = None) -> tuple[list[Tensor], TreeSpec]:
    leaves, got = tree_flatten(tree)
    if spec is not None and got != spec:
        raise ValueError(f"{what} do not have the structure of the parameters: expected {spec}, "
                         f"got {got}; pass {what} in the same dict/tuple layout as the params")
    for leaf in leaves:
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{what} must be a pytree of tensors, found a {type(leaf).__name__} "
                            "leaf; replace None gradients by zeros (e.g. "
                            "torch.autograd.grad(..., materialize_grads=True))")
    return leaves, got


def _write(targets: list[Tensor], values: list[Tensor]) -> list[Tensor]:
    """``inplace=True``: land results in existing storage (no autograd through them)."""
    with torch.no_grad():
        for t, v in zip(targets, values, strict=True):
            t.copy_(v)
    return targets


def _check_scalar(name: str, value: Scalar, low: float, high: float | None = None) -> None:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape "
                             f"{tuple(value.shape)}")
        return
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r} is invalid; it must be {bound}")


class Transformation(ABC):
    """A differentiable optimiser: ``init`` builds its state, ``update`` maps gradients (and
    the current params) to parameter updates and the next state."""

    @abstractmethod
    def init(self, params: PyTree) -> Any:
        """The initial state for ``params`` (zeros shaped like them; no autograd history)."""

    def update(self, grads: PyTree, state: Any, *, params: PyTree | None = None,
               inplace: bool = False) -> tuple[PyTree, Any]:
        """``(updates, new_state)``: add ``updates`` to the params (:func:`apply_updates`).

        ``params`` is needed when weight decay is on. With ``inplace=False`` (the default, and
        what differentiable inner loops need) nothing is modified and the result stays in the
        autograd graph of ``grads``, ``state``, ``params`` and tensor hyperparameters. With
        ``inplace=True`` the updates are written into ``grads``' tensors and the new state
        into ``state``'s tensors, outside autograd (for plain, non-differentiable loops that
        keep their buffers preallocated); the arithmetic is the same.
        """
        g, spec = _flat(grads, "grads")
        p = None if params is None else _flat(params, "params", spec)[0]
        updates, new_state = self._step(g, p, state, spec)
        if inplace:
            # State first: on a first step the new momentum buffer *is* the gradient tensor,
            # which the updates overwrite next.
            new_state = self._written(state, new_state, spec)
            updates = _write(g, updates)
        return tree_unflatten(updates, spec), new_state

    @abstractmethod
    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], Any]:
        """The maths on flat lists; returns flat updates and the new (tree-shaped) state."""

    @abstractmethod
    def _written(self, old: Any, new: Any, spec: TreeSpec) -> Any:
        """``new`` with its tensors copied into ``old``'s storage (``inplace=True``)."""

    def _decay_params(self, params: list[Tensor] | None, weight_decay: float) -> list[Tensor]:
        if params is None:
            raise ValueError(f"{type(self).__name__.lower()}(weight_decay={weight_decay}) needs "
                             "the current parameters: call update(grads, state, params=params)")
        return params


@dataclasses.dataclass(frozen=True, eq=False)
class SGD(Transformation):
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay,
    as ``torch.optim.SGD`` (the first step seeds the momentum buffer with the gradient)."""

    lr: Scalar
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        _check_scalar("lr", self.lr, 0.0)
        _check_scalar("momentum", self.momentum, 0.0)
        _check_scalar("weight_decay", self.weight_decay, 0.0)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening=0 (as in "
                             f"torch.optim.SGD); got momentum={self.momentum}, "
                             f"dampening={self.dampening}")

    def init(self, params: PyTree) -> SGDState:
        if self.momentum == 0:
            return SGDState(0, None)
        leaves, spec = _flat(params, "params")
        return SGDState(0, tree_unflatten([torch.zeros_like(p.detach()) for p in leaves], spec))

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], SGDState]:
        if not isinstance(state, SGDState):
            raise TypeError(f"sgd.update needs the SGDState from sgd.init, got "
                            f"{type(state).__name__}")
        if self.maximize:
            grads = [-g for g in grads]
        if self.weight_decay != 0:
            decayed = self._decay_params(params, self.weight_decay)
            grads = [g.add(p, alpha=self.weight_decay) for g, p in zip(grads, decayed, strict=True)]
        buffers: list[Tensor] | None = None
        if self.momentum != 0:
            if state.momentum is None:
                raise ValueError("this SGDState has no momentum buffers; build the state with "
                                 "the same sgd(momentum=...) that updates it")
            old = _flat(state.momentum, "momentum buffers", spec)[0]
            if state.steps == 0:
                buffers = list(grads)  # torch seeds the buffer with the first gradient
            else:
                buffers = [torch.add(b * self.momentum, g, alpha=1 - self.dampening)
                           for b, g in zip(old, grads, strict=True)]
            if self.nesterov:
                grads = [g.add(b, alpha=self.momentum) for g, b in zip(grads, buffers, strict=True)]
            else:
                grads = buffers
        lr = self.lr
        updates = [g * (-lr) if isinstance(lr, Tensor) else g.mul(-lr) for g in grads]
        momentum = None if buffers is None else tree_unflatten(buffers, spec)
        return updates, SGDState(state.steps + 1, momentum)

    def _written(self, old: Any, new: Any, spec: TreeSpec) -> SGDState:
        if new.momentum is None:
            return SGDState(new.steps, None)
        written = _write(_flat(old.momentum, "momentum buffers", spec)[0],
                         _flat(new.momentum, "momentum buffers", spec)[0])
        return SGDState(new.steps, tree_unflatten(written, spec))


@dataclasses.dataclass(frozen=True, eq=False)
class Adam(Transformation):
    """Adam (``decoupled=False``, L2 weight decay added to the gradient) or AdamW
    (``decoupled=True``, parameters shrunk by ``lr * weight_decay``), as ``torch.optim``."""

    lr: Scalar = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    decoupled: bool = False

    def __post_init__(self) -> None:
        _check_scalar("lr", self.lr, 0.0)
        _check_scalar("betas[0]", self.betas[0], 0.0, 1.0)
        _check_scalar("betas[1]", self.betas[1], 0.0, 1.0)
        _check_scalar("eps", self.eps, 0.0)
        _check_scalar("weight_decay", self.weight_decay, 0.0)

    def init(self, params: PyTree) -> AdamState:
        leaves, spec = _flat(params, "params")

        def zeros() -> PyTree:
            return tree_unflatten([torch.zeros_like(p.detach()) for p in leaves], spec)

        return AdamState(0, zeros(), zeros())

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], AdamState]:
        if not isinstance(state, AdamState):
            raise TypeError(f"{'adamw' if self.decoupled else 'adam'}.update needs the AdamState "
                            f"from its init, got {type(state).__name__}")
        beta1, beta2 = self.betas
        lr, wd = self.lr, self.weight_decay
        if self.maximize:
            grads = [-g for g in grads]
        decayed = self._decay_params(params, wd) if wd != 0 else None
        if decayed is not None and not self.decoupled:
            grads = [g.add(p, alpha=wd) for g, p in zip(grads, decayed, strict=True)]
        count = state.steps + 1
        # Python floats, exactly as torch computes them for float (non-tensor) hyperparameters.
        bias1 = 1 - beta1**count
        bias2_sqrt = (1 - beta2**count) ** 0.5
        mus, nus, updates = [], [], []
        old_mu = _flat(state.mu, "first moments", spec)[0]
        old_nu = _flat(state.nu, "second moments", spec)[0]
        for i, g in enumerate(grads):
            mu = torch.lerp(old_mu[i], g, 1 - beta1)
            nu = torch.addcmul(old_nu[i] * beta2, g, g, value=1 - beta2)
            denom = nu.sqrt() / bias2_sqrt + self.eps
            step = mu / denom
            update = step * (-lr / bias1) if isinstance(lr, Tensor) else step.mul(-lr / bias1)
            if decayed is not None and self.decoupled:
                update = update - decayed[i] * (lr * wd)
            mus.append(mu)
            nus.append(nu)
            updates.append(update)
        return updates, AdamState(count, tree_unflatten(mus, spec), tree_unflatten(nus, spec))

    def _written(self, old: Any, new: Any, spec: TreeSpec) -> AdamState:
        mu = _write(_flat(old.mu, "first moments", spec)[0], _flat(new.mu, "mu", spec)[0])
        nu = _write(_flat(old.nu, "second moments", spec)[0], _flat(new.nu, "nu", spec)[0])
        return AdamState(new.steps, tree_unflatten(mu, spec), tree_unflatten(nu, spec))


def sgd(lr: Scalar, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, maximize: bool = False) -> SGD:
    """Differentiable SGD (``torch.optim.SGD`` maths); ``lr`` may be a tensor."""
    return SGD(lr, momentum, dampening, nesterov, weight_decay, maximize)


def adam(lr: Scalar = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, maximize: bool = False) -> Adam:
    """Differentiable Adam (``torch.optim.Adam`` maths, L2 weight decay); ``lr`` may be a
    tensor."""
    return Adam(lr, betas, eps, weight_decay, maximize, decoupled=False)


def adamw(lr: Scalar = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, maximize: bool = False) -> Adam:
    """Differentiable AdamW (``torch.optim.AdamW`` maths, decoupled weight decay)."""
    return Adam(lr, betas, eps, weight_decay, maximize, decoupled=True)


def apply_updates(params: PyTree, updates: PyTree, *, inplace: bool = False) -> PyTree:
    """``params + updates`` leaf by leaf. Out of place (differentiable) by default; with
    ``inplace=True`` the params' tensors are incremented outside autograd and returned."""
    p, spec = _flat(params, "params")
    u = _flat(updates, "updates", spec)[0]
    if inplace:
        with torch.no_grad():
            for a, b in zip(p, u, strict=True):
                a.add_(b)
        return params
    return tree_unflatten([a + b for a, b in zip(p, u, strict=True)], spec)
