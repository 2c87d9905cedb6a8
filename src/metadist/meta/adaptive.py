"""Adaptive differentiable optimisers: RMSprop, Adagrad, Adadelta, Adamax and RAdam.

Same contract as :mod:`metadist.meta.transforms` (pure ``init``/``update``, everything in the
autograd graph, ``lr`` may be a tensor), and the same promise: the arithmetic is
``torch.optim``'s single-tensor code operation by operation, defaults included, so that with
detached gradients the iterates agree with torch's to rounding. Where TorchOpt 0.7.3 adds an
option torch lacks (RMSprop's ``initial_scale`` and ``nesterov``, ``moment_requires_grad``
everywhere) it is offered with TorchOpt's meaning; its default keeps torch's maths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_unflatten

from metadist.meta.transforms import (
    PyTree,
    Scalar,
    Transformation,
    _check_scalar,
    _flat,
    _scaled,
    _write_state,
    _zeros,
)


class RMSPropState(NamedTuple):
    """State of :func:`rmsprop`: running mean of squared gradients, of gradients (``None``
    unless ``centered``) and the momentum buffers (``None`` without momentum)."""

    steps: int
    square_avg: PyTree
    grad_avg: PyTree | None
    momentum: PyTree | None


class AdaGradState(NamedTuple):
    """State of :func:`adagrad`: the running sum of squared gradients."""

    steps: int
    sum: PyTree


class AdaDeltaState(NamedTuple):
    """State of :func:`adadelta`: running means of squared gradients and squared updates."""

    steps: int
    square_avg: PyTree
    acc_delta: PyTree


class AdaMaxState(NamedTuple):
    """State of :func:`adamax`: first moment and exponentially weighted infinity norm."""

    steps: int
    mu: PyTree
    inf_norm: PyTree


class RAdamState(NamedTuple):
    """State of :func:`radam`: first and second moments."""

    steps: int
    mu: PyTree
    nu: PyTree


class _Adaptive(Transformation):
    """Shared plumbing: state checks, sign flip and L2 weight decay (torch's order: negate for
    ``maximize``, then add ``weight_decay * param``)."""

    weight_decay: float
    maximize: bool

    def _expect(self, state: Any, cls: type) -> None:
        if not isinstance(state, cls):
            name = type(self).__name__.lower()
            raise TypeError(f"{name}.update needs the {cls.__name__} from {name}.init, got "
                            f"{type(state).__name__}; build the state with the same "
                            "transformation that updates it")

    def _grads(self, grads: list[Tensor], params: list[Tensor] | None) -> list[Tensor]:
        if self.maximize:
            grads = [-g for g in grads]
        if self.weight_decay != 0:
            decayed = self._decay_params(params, self.weight_decay)
            grads = [g.add(p, alpha=self.weight_decay) for g, p in zip(grads, decayed, strict=True)]
        return grads

    def _written(self, old: Any, new: Any, spec: TreeSpec) -> Any:
        return _write_state(old, new, spec)


def _check_moments(t: Any) -> None:
    """The hyperparameters of Adam-like transformations (lr, betas, eps, weight_decay)."""
    _check_scalar("lr", t.lr, 0.0)
    _check_scalar("betas[0]", t.betas[0], 0.0, 1.0)
    _check_scalar("betas[1]", t.betas[1], 0.0, 1.0)
    _check_scalar("eps", t.eps, 0.0)
    _check_scalar("weight_decay", t.weight_decay, 0.0)


def _two_moments(params: PyTree, requires_grad: bool) -> tuple[PyTree, PyTree]:
    """Two zero states shaped like ``params`` (first moment, second moment or norm)."""
    leaves, spec = _flat(params, "params")
    return _zeros(leaves, spec, requires_grad), _zeros(leaves, spec, requires_grad)


@dataclasses.dataclass(frozen=True, eq=False)
class RMSProp(_Adaptive):
    """``torch.optim.RMSprop``: ``v = alpha v + (1 - alpha) g^2``, divide by
    ``sqrt(v - m^2) + eps`` (``m`` the running mean of ``g`` when ``centered``, else 0),
    optionally through momentum. TorchOpt's extras: ``initial_scale`` (the initial ``v``) and
    ``nesterov`` (update ``-lr (u + momentum * buf)`` with ``u`` the scaled gradient)."""

    lr: Scalar = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False
    initial_scale: float = dataclasses.field(default=0.0, kw_only=True)
    nesterov: bool = dataclasses.field(default=False, kw_only=True)
    moment_requires_grad: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        _check_scalar("lr", self.lr, 0.0)
        for name in ("alpha", "eps", "weight_decay", "momentum", "initial_scale"):
            _check_scalar(name, getattr(self, name), 0.0)
        if self.nesterov and self.momentum <= 0:
            raise ValueError("rmsprop(nesterov=True) needs momentum > 0, got "
                             f"momentum={self.momentum}")

    def init(self, params: PyTree) -> RMSPropState:
        leaves, spec = _flat(params, "params")
        grad = self.moment_requires_grad
        return RMSPropState(0, _zeros(leaves, spec, grad, self.initial_scale),
                            _zeros(leaves, spec, grad) if self.centered else None,
                            _zeros(leaves, spec, grad) if self.momentum > 0 else None)

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], RMSPropState]:
        self._expect(state, RMSPropState)
        grads = self._grads(grads, params)
        if (state.grad_avg is None) == self.centered or \
                (state.momentum is None) == (self.momentum > 0):
            raise ValueError("this RMSPropState was built for other centered/momentum settings; "
                             "build it with the same rmsprop(...) that updates it")
        old_sq = _flat(state.square_avg, "square averages", spec)[0]
        old_ga = _flat(state.grad_avg, "grad averages", spec)[0] if self.centered else []
        old_buf = _flat(state.momentum, "momentum buffers", spec)[0] if self.momentum > 0 else []
        squares, means, buffers, updates = [], [], [], []
        for i, g in enumerate(grads):
            sq = torch.addcmul(old_sq[i] * self.alpha, g, g, value=1 - self.alpha)
            squares.append(sq)
            if self.centered:
                ga = torch.lerp(old_ga[i], g, 1 - self.alpha)
                means.append(ga)
                avg = torch.addcmul(sq, ga, ga, value=-1).sqrt()
            else:
                avg = sq.sqrt()
            avg = avg.add(self.eps)
            if self.momentum > 0:
                buf = torch.addcdiv(old_buf[i] * self.momentum, g, avg)
                buffers.append(buf)
                # torch: param.add_(buf, alpha=-lr); TorchOpt's nesterov: u + momentum * buf
                step = (g / avg).add(buf, alpha=self.momentum) if self.nesterov else buf
                updates.append(_scaled(step, -self.lr))
            else:  # torch: param.addcdiv_(grad, avg, value=-lr)
                updates.append(_scaled(g, -self.lr) / avg)
        new = RMSPropState(state.steps + 1, tree_unflatten(squares, spec),
                           tree_unflatten(means, spec) if self.centered else None,
                           tree_unflatten(buffers, spec) if self.momentum > 0 else None)
        return updates, new


@dataclasses.dataclass(frozen=True, eq=False)
class AdaGrad(_Adaptive):
    """``torch.optim.Adagrad``: ``s += g^2``, step ``-lr / (1 + (t - 1) lr_decay) * g /
    (sqrt(s) + eps)`` at step ``t``."""

    lr: Scalar = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        _check_scalar("lr", self.lr, 0.0)
        for name in ("lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            _check_scalar(name, getattr(self, name), 0.0)

    def init(self, params: PyTree) -> AdaGradState:
        leaves, spec = _flat(params, "params")
        return AdaGradState(0, _zeros(leaves, spec, fill=self.initial_accumulator_value))

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], AdaGradState]:
        self._expect(state, AdaGradState)
        grads = self._grads(grads, params)
        clr = self.lr / (1 + state.steps * self.lr_decay)
        sums, updates = [], []
        for g, old in zip(grads, _flat(state.sum, "sums", spec)[0], strict=True):
            total = torch.addcmul(old, g, g, value=1)
            sums.append(total)
            updates.append(_scaled(g, -clr) / total.sqrt().add(self.eps))
        return updates, AdaGradState(state.steps + 1, tree_unflatten(sums, spec))


@dataclasses.dataclass(frozen=True, eq=False)
class AdaDelta(_Adaptive):
    """``torch.optim.Adadelta``: ``v = rho v + (1 - rho) g^2``, ``d = sqrt(a + eps) /
    sqrt(v + eps) * g``, ``a = rho a + (1 - rho) d^2``, step ``-lr * d``."""

    lr: Scalar = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    maximize: bool = False
    moment_requires_grad: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        _check_scalar("lr", self.lr, 0.0)
        _check_scalar("rho", self.rho, 0.0)
        if self.rho > 1:
            raise ValueError(f"rho={self.rho!r} is invalid; it must be in [0, 1]")
        _check_scalar("eps", self.eps, 0.0)
        _check_scalar("weight_decay", self.weight_decay, 0.0)

    def init(self, params: PyTree) -> AdaDeltaState:
        leaves, spec = _flat(params, "params")
        grad = self.moment_requires_grad
        return AdaDeltaState(0, _zeros(leaves, spec, grad), _zeros(leaves, spec, grad))

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], AdaDeltaState]:
        self._expect(state, AdaDeltaState)
        grads = self._grads(grads, params)
        old_sq = _flat(state.square_avg, "square averages", spec)[0]
        old_acc = _flat(state.acc_delta, "accumulated deltas", spec)[0]
        rho = self.rho
        squares, accs, updates = [], [], []
        for g, sq0, acc0 in zip(grads, old_sq, old_acc, strict=True):
            sq = torch.addcmul(sq0 * rho, g, g, value=1 - rho)
            delta = acc0.add(self.eps).sqrt() / sq.add(self.eps).sqrt() * g
            squares.append(sq)
            accs.append(torch.addcmul(acc0 * rho, delta, delta, value=1 - rho))
            updates.append(_scaled(delta, -self.lr))
        return updates, AdaDeltaState(state.steps + 1, tree_unflatten(squares, spec),
                                      tree_unflatten(accs, spec))


@dataclasses.dataclass(frozen=True, eq=False)
class AdaMax(_Adaptive):
    """``torch.optim.Adamax``: ``m = lerp(m, g, 1 - beta1)``, ``u = max(beta2 u, |g| + eps)``,
    step ``-lr / (1 - beta1^t) * m / u``."""

    lr: Scalar = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    moment_requires_grad: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        _check_moments(self)

    def init(self, params: PyTree) -> AdaMaxState:
        return AdaMaxState(0, *_two_moments(params, self.moment_requires_grad))

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], AdaMaxState]:
        self._expect(state, AdaMaxState)
        grads = self._grads(grads, params)
        beta1, beta2 = self.betas
        count = state.steps + 1
        clr = self.lr / (1 - beta1**count)
        old_mu = _flat(state.mu, "first moments", spec)[0]
        old_inf = _flat(state.inf_norm, "infinity norms", spec)[0]
        mus, infs, updates = [], [], []
        for g, mu0, inf0 in zip(grads, old_mu, old_inf, strict=True):
            mu = torch.lerp(mu0, g, 1 - beta1)
            inf = torch.maximum(inf0 * beta2, g.abs().add(self.eps))
            mus.append(mu)
            infs.append(inf)
            updates.append(_scaled(mu, -clr) / inf)  # torch: addcdiv_(m, u, value=-clr)
        return updates, AdaMaxState(count, tree_unflatten(mus, spec), tree_unflatten(infs, spec))


@dataclasses.dataclass(frozen=True, eq=False)
class RAdam(_Adaptive):
    """``torch.optim.RAdam``: Adam's moments, with the adaptive step used only once the
    variance is tractable (``rho_t > 5``) and rectified; plain bias-corrected momentum before.
    ``decoupled_weight_decay=True`` shrinks the parameters by ``lr * weight_decay`` instead of
    adding L2 to the gradient (torch's flag)."""

    lr: Scalar = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    maximize: bool = False
    moment_requires_grad: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        _check_moments(self)

    def init(self, params: PyTree) -> RAdamState:
        return RAdamState(0, *_two_moments(params, self.moment_requires_grad))

    def _step(self, grads: list[Tensor], params: list[Tensor] | None, state: Any,
              spec: TreeSpec) -> tuple[list[Tensor], RAdamState]:
        self._expect(state, RAdamState)
        if self.maximize:
            grads = [-g for g in grads]
        lr, wd = self.lr, self.weight_decay
        decayed = self._decay_params(params, wd) if wd != 0 else None
        if decayed is not None and not self.decoupled_weight_decay:
            grads = [g.add(p, alpha=wd) for g, p in zip(grads, decayed, strict=True)]
        beta1, beta2 = self.betas
        count = state.steps + 1
        # Python floats, as torch computes them for float hyperparameters.
        bias1, bias2 = 1 - beta1**count, 1 - beta2**count
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * count * (beta2**count) / bias2
        rect = None
        if rho_t > 5.0:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                             / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        old_mu = _flat(state.mu, "first moments", spec)[0]
        old_nu = _flat(state.nu, "second moments", spec)[0]
        mus, nus, updates = [], [], []
        for i, g in enumerate(grads):
            mu = torch.lerp(old_mu[i], g, 1 - beta1)
            nu = torch.addcmul(old_nu[i] * beta2, g, g, value=1 - beta2)
            mus.append(mu)
            nus.append(nu)
            step = _scaled(mu / bias1, lr)
            if rect is not None:
                step = step * ((bias2**0.5) / nu.sqrt().add(self.eps)) * rect
            update = -step
            if decayed is not None and self.decoupled_weight_decay:
                update = update - decayed[i] * (lr * wd)
            updates.append(update)
        return updates, RAdamState(count, tree_unflatten(mus, spec), tree_unflatten(nus, spec))


def rmsprop(lr: Scalar = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
            weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False,
            maximize: bool = False, *, initial_scale: float = 0.0, nesterov: bool = False,
            moment_requires_grad: bool = False) -> RMSProp:
    """Differentiable RMSprop (``torch.optim.RMSprop`` maths and defaults)."""
    return RMSProp(lr, alpha, eps, weight_decay, momentum, centered, maximize,
                   initial_scale=initial_scale, nesterov=nesterov,
                   moment_requires_grad=moment_requires_grad)


def adagrad(lr: Scalar = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
            initial_accumulator_value: float = 0.0, eps: float = 1e-10,
            maximize: bool = False) -> AdaGrad:
    """Differentiable Adagrad (``torch.optim.Adagrad`` maths and defaults)."""
    return AdaGrad(lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize)


def adadelta(lr: Scalar = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
             maximize: bool = False, *, moment_requires_grad: bool = False) -> AdaDelta:
    """Differentiable Adadelta (``torch.optim.Adadelta`` maths and defaults)."""
    return AdaDelta(lr, rho, eps, weight_decay, maximize,
                    moment_requires_grad=moment_requires_grad)


def adamax(lr: Scalar = 2e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           weight_decay: float = 0.0, maximize: bool = False, *,
           moment_requires_grad: bool = False) -> AdaMax:
    """Differentiable Adamax (``torch.optim.Adamax`` maths and defaults)."""
    return AdaMax(lr, betas, eps, weight_decay, maximize,
                  moment_requires_grad=moment_requires_grad)


def radam(lr: Scalar = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.0, decoupled_weight_decay: bool = False,
          maximize: bool = False, *, moment_requires_grad: bool = False) -> RAdam:
    """Differentiable RAdam (``torch.optim.RAdam`` maths and defaults)."""
    return RAdam(lr, betas, eps, weight_decay, decoupled_weight_decay, maximize,
                 moment_requires_grad=moment_requires_grad)
