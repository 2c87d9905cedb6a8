"""Differentiable optimisers as pure transformations of parameter pytrees.

``transform.init(params) -> state`` and ``transform.update(grads, state, params=...) ->
(updates, new_state)``, then ``apply_updates(params, updates)``. Nothing is modified in place
(unless asked), so every update, and the optimiser state (momentum buffers, Adam moments), is
part of the autograd graph: an outer backward flows through all inner steps, through the
state, and into tensor hyperparameters such as a learnable learning rate.

The arithmetic follows ``torch.optim`` (SGD, Adam, AdamW here; RMSprop, Adagrad, Adadelta,
Adamax and RAdam in :mod:`metadist.meta.adaptive`) operation by operation, so with detached
gradients the iterates agree with torch's to rounding. Flags that torch lacks (``eps_root``,
``moment_requires_grad``, ``mask``) take TorchOpt's meaning; :mod:`metadist.meta.combine`
chains transformations.

Params, grads and states are pytrees (dicts, tuples, lists, nested) of tensors; grads must have
the structure of the params. States are NamedTuples whose tensor fields mirror that structure
and whose step counter ``steps`` is a plain int (bias corrections are then exact Python floats,
as in torch, and reading the counter never synchronises a GPU).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

PyTree = Any
Scalar = float | Tensor  # learning rates may be tensors (learnable, part of the graph)
Mask = PyTree | Callable[[PyTree], PyTree]  # bools shaped like the params, or params -> those


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


def _write_state(old: Any, new: Any, spec: TreeSpec) -> Any:
    """``new`` (a state NamedTuple) with every tensor-tree field copied into ``old``'s storage;
    ints and ``None`` fields are taken as they are."""
    fields: dict[str, Any] = {}
    for name in new._fields:
        value = getattr(new, name)
        if isinstance(value, int) or value is None:
            fields[name] = value
        else:
            target = _flat(getattr(old, name), f"state field {name!r}", spec)[0]
            written = _write(target, _flat(value, f"state field {name!r}", spec)[0])
            fields[name] = tree_unflatten(written, spec)
    return type(new)(**fields)


def _zeros(leaves: list[Tensor], spec: TreeSpec, requires_grad: bool = False,
           fill: float = 0.0) -> PyTree:
    """Fresh state tensors shaped like ``leaves``, outside any graph; ``requires_grad=True``
    (TorchOpt's ``moment_requires_grad``) makes them leaves that outer gradients can reach."""
    return tree_unflatten([torch.full_like(p.detach(), fill).requires_grad_(requires_grad)
                           for p in leaves], spec)


def _scaled(x: Tensor, factor: Scalar) -> Tensor:
    """``x * factor``; a tensor factor stays in the graph (a learnable learning rate)."""
    return x * factor if isinstance(factor, Tensor) else x.mul(factor)


def _mask_flags(mask: Mask | None, params: list[Tensor], spec: TreeSpec) -> list[bool]:
    """One bool per parameter leaf: where weight decay applies (all of them without a mask)."""
    if mask is None:
        return [True] * len(params)
    tree = mask(tree_unflatten(params, spec)) if callable(mask) else mask
    flags, got = tree_flatten(tree)
    if got != spec:
        raise ValueError(f"the weight-decay mask does not have the structure of the parameters: "
                         f"expected {spec}, got {got}; give one bool per parameter, in the "
                         "params' dict/tuple layout (or a callable params -> such a tree)")
    return [bool(f) for f in flags]


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
    (``decoupled=True``, parameters shrunk by ``lr * weight_decay``), as ``torch.optim``.

    TorchOpt's extras: ``eps_root`` goes inside the square root of the bias-corrected second
    moment, ``sqrt(nu / (1 - beta2**t) + eps_root) + eps`` (``0.0`` keeps torch's expression);
    ``moment_requires_grad`` makes the initial moments leaves with ``requires_grad``; ``mask``
    (bools shaped like the params, or a callable params -> such a tree) limits weight decay to
    the leaves marked True.
    """

    lr: Scalar = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    decoupled: bool = False
    eps_root: float = dataclasses.field(default=0.0, kw_only=True)
    moment_requires_grad: bool = dataclasses.field(default=False, kw_only=True)
    mask: Mask | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _check_scalar("lr", self.lr, 0.0)
        _check_scalar("betas[0]", self.betas[0], 0.0, 1.0)
        _check_scalar("betas[1]", self.betas[1], 0.0, 1.0)
        _check_scalar("eps", self.eps, 0.0)
        _check_scalar("eps_root", self.eps_root, 0.0)
        _check_scalar("weight_decay", self.weight_decay, 0.0)

    def init(self, params: PyTree) -> AdamState:
        leaves, spec = _flat(params, "params")
        grad = self.moment_requires_grad
        return AdamState(0, _zeros(leaves, spec, grad), _zeros(leaves, spec, grad))

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
        flags = [] if decayed is None else _mask_flags(self.mask, decayed, spec)
        if decayed is not None and not self.decoupled:
            grads = [g.add(p, alpha=wd) if on else g
                     for g, p, on in zip(grads, decayed, flags, strict=True)]
        count = state.steps + 1
        # Python floats, exactly as torch computes them for float (non-tensor) hyperparameters.
        bias1 = 1 - beta1**count
        bias2 = 1 - beta2**count
        bias2_sqrt = bias2**0.5
        mus, nus, updates = [], [], []
        old_mu = _flat(state.mu, "first moments", spec)[0]
        old_nu = _flat(state.nu, "second moments", spec)[0]
        for i, g in enumerate(grads):
            mu = torch.lerp(old_mu[i], g, 1 - beta1)
            nu = torch.addcmul(old_nu[i] * beta2, g, g, value=1 - beta2)
            if self.eps_root == 0:
                denom = nu.sqrt() / bias2_sqrt + self.eps
            else:  # TorchOpt's placement: sqrt(nu_hat + eps_root) + eps
                denom = (nu / bias2 + self.eps_root).sqrt() + self.eps
            update = _scaled(mu / denom, -lr / bias1)
            if decayed is not None and self.decoupled and flags[i]:
                update = update - decayed[i] * (lr * wd)
            mus.append(mu)
            nus.append(nu)
            updates.append(update)
        return updates, AdamState(count, tree_unflatten(mus, spec), tree_unflatten(nus, spec))

    def _written(self, old: Any, new: Any, spec: TreeSpec) -> AdamState:
        written: AdamState = _write_state(old, new, spec)
        return written


def sgd(lr: Scalar, momentum: float = 0.0, *, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, maximize: bool = False) -> SGD:
    """Differentiable SGD (``torch.optim.SGD`` maths); ``lr`` may be a tensor. Options after
    ``momentum`` are keyword-only: torch puts ``weight_decay`` 4th, TorchOpt's ``sgd`` too,
    and a positional call that meant either would silently set another option here."""
    return SGD(lr, momentum, dampening, nesterov, weight_decay, maximize)


def adam(lr: Scalar = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, maximize: bool = False, *, eps_root: float = 0.0,
         moment_requires_grad: bool = False) -> Adam:
    """Differentiable Adam (``torch.optim.Adam`` maths, L2 weight decay); ``lr`` may be a
    tensor. ``eps_root``/``moment_requires_grad``: see :class:`Adam`."""
    return Adam(lr, betas, eps, weight_decay, maximize, decoupled=False, eps_root=eps_root,
                moment_requires_grad=moment_requires_grad)


def adamw(lr: Scalar = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, maximize: bool = False, *, eps_root: float = 0.0,
          moment_requires_grad: bool = False, mask: Mask | None = None) -> Adam:
    """Differentiable AdamW (``torch.optim.AdamW`` maths, decoupled weight decay), decaying
    only the leaves ``mask`` marks True (all without one); other flags: see :class:`Adam`."""
    return Adam(lr, betas, eps, weight_decay, maximize, decoupled=True, eps_root=eps_root,
                moment_requires_grad=moment_requires_grad, mask=mask)


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
