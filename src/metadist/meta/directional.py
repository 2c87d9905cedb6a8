"""Hypergradients from one directional finite difference at the current inner iterate.

Both methods have the signature of :mod:`metadist.meta.hypergrad`'s methods and, like them,
sync every data-dependent quantity through ``grad_sync``, so the result is the global-batch
value on every rank.

* ``sama``: gF_lam - M.(P v), v = dF/dtheta, with the mixed product by a central finite
  difference, (dG/dlam(w + eps Pv) - dG/dlam(w - eps Pv)) / (2 eps), eps = r / |Pv|. ``P``
  (``SamaConfig.scale``) is the diagonal derivative of the inner optimizer's last update with
  respect to its gradient (:func:`adam_scale` for Adam, the learning rate for SGD), which
  makes the response that of one real optimizer step; ``scale=None`` is P = I, the
  "gF - M.v" approximation (an identity inverse Hessian).
* ``reinforce``: the same response for inner losses that are not differentiable in the
  hyperparameters, because they reach them only through samples drawn from a distribution
  the hyperparameters define. The score-function estimator
  -xi * grad_lam mean_i[d_i log p_lam(z_i)], d_i = v . dg_i/dtheta (each sample's directional
  derivative, by the same finite difference), is unbiased for -xi * M.v of the expected
  inner loss. The inner loss function returns a mapping with ``"losses"`` (per sample, shape
  ``(B,)``) and ``"log_prob"`` (log p_lam(z_i) of each sample, differentiable in lam).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from metadist.meta import fast_space
from metadist.meta.fast_space import Hparams, HparamsLike
from metadist.meta.optim import GradSync

LossFn = Callable[[Any, tuple[Tensor, ...]], Any]
_TINY = 1e-15  # keeps eps finite when the direction vanishes


@dataclasses.dataclass(frozen=True)
class SamaConfig:
    """``r``: the finite difference's radius (eps = r / |P v|); ``scale``: the diagonal
    preconditioner P as a pytree shaped like ``params`` (None: the identity)."""

    r: float = 1.0
    scale: Any = None

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"SamaConfig needs r > 0, got r={self.r}")


@dataclasses.dataclass(frozen=True)
class ReinforceConfig:
    """``xi``: the inner learning rate the response is scaled by; ``r``: the finite
    difference's radius for the per-sample directional derivatives (eps = r / |v|)."""

    xi: float = 1.0
    r: float = 0.01

    def __post_init__(self) -> None:
        if self.xi < 0 or self.r <= 0:
            raise ValueError(f"ReinforceConfig needs xi >= 0 and r > 0, got xi={self.xi}, "
                             f"r={self.r}")


def adam_scale(group: Mapping[str, Any], state: Mapping[str, Tensor]) -> Tensor:
    """d(update)/d(gradient) of Adam's last step, elementwise and times the learning rate
    (bias correction left out; ``state["last_grad"]`` is the gradient that step used)."""
    beta1, beta2 = group["betas"]
    eps, m, v = group["eps"], state["exp_avg"], state["exp_avg_sq"]
    g = state.get("last_grad", torch.zeros_like(m))
    with torch.no_grad():
        m_old = (m - (1 - beta1) * g) / beta1 if beta1 != 0 else torch.zeros_like(m)
        v_old = (v - (1 - beta2) * g * g) / beta2
        scale = (1 - beta1) * beta2 * v_old - beta1 * (1 - beta2) * g * m_old
        out: Tensor = scale / (v.sqrt() + eps) ** 3 * group["lr"]
        return out


def _flat(params: Any) -> tuple[list[Tensor], Any]:
    leaves, spec = tree_flatten(params)
    if not leaves or not all(isinstance(p, Tensor) for p in leaves):
        raise TypeError("params must be a non-empty tuple/dict (pytree) of tensors")
    return [p.detach().requires_grad_(True) for p in leaves], spec


def _grad(out: Tensor, inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    return torch.autograd.grad(out, list(inputs), allow_unused=True, materialize_grads=True)


def _norm(v: Sequence[Tensor]) -> float:
    """|v| over every inner parameter (over every shard, inside ``fast_space.over``)."""
    with fast_space.shard_internals():  # made the sum over every shard below
        flat = torch.cat([x.reshape(-1) for x in v])
        if not fast_space.sharded_now():
            return float(flat.norm())
        return float(fast_space.over_theta((flat * flat).sum()).sqrt())


def scaled(v: list[Tensor], scale: Any) -> list[Tensor]:
    """P v for the diagonal preconditioner ``scale`` (a pytree like v; None: v)."""
    if scale is None:
        return v
    leaves, _ = tree_flatten(scale)
    if len(leaves) != len(v) or any(s.shape != x.shape for s, x in zip(leaves, v,
                                                                         strict=False)):
        raise ValueError("SamaConfig.scale must be laid out like params: for fast weights "
                         "(model.fast_weights()), pass fast.like({name: scale})")
    return [s.to(x.dtype) * x for s, x in zip(leaves, v, strict=True)]


def _shifted(theta: list[Tensor], v: Sequence[Tensor], eps: float) -> tuple[list[Tensor], ...]:
    with torch.no_grad():  # one fused kernel launch per side
        return (list(torch._foreach_add(theta, list(v), alpha=eps)),
                list(torch._foreach_add(theta, list(v), alpha=-eps)))


def outer_grads(outer_loss_fn: LossFn, theta: list[Tensor], spec: Any, lam: Hparams,
                grad_sync: GradSync | None) -> tuple[list[Tensor], list[Tensor]]:
    """(dF/dtheta, dF/dlam) at ``theta``, synced together."""
    with fast_space.over(spec, lam):
        f = outer_loss_fn(tree_unflatten(theta, spec), lam.tree())
        both = fast_space.sync_split(grad_sync, _grad(f, [*theta, *lam]), len(theta), spec,
                                     lam)
    return list(both[:len(theta)]), list(both[len(theta):])


def mixed_fd(inner_loss_fn: LossFn, theta: list[Tensor], spec: Any, lam: Hparams,
             w: Sequence[Tensor], r: float, grad_sync: GradSync | None, *,
             sign: float = 1.0) -> list[Tensor]:
    """sign * M.w ~ sign * (dG/dlam(theta + eps w) - dG/dlam(theta - eps w)) / (2 eps),
    eps = r / |w| (both sides synced in one collective; the sign folded into the division)."""
    with fast_space.over(spec, lam):
        return _mixed_fd(inner_loss_fn, theta, spec, lam, w, r, grad_sync, sign)


def _mixed_fd(inner_loss_fn: LossFn, theta: list[Tensor], spec: Any, lam: Hparams,
              w: Sequence[Tensor], r: float, grad_sync: GradSync | None, sign: float
              ) -> list[Tensor]:
    eps = r / (_norm(w) + _TINY)
    plus, minus = _shifted(theta, w, eps)
    g_plus = _grad(inner_loss_fn(tree_unflatten(plus, spec), lam.tree()), lam)
    g_minus = _grad(inner_loss_fn(tree_unflatten(minus, spec), lam.tree()), lam)
    both = fast_space.sync_lam(grad_sync, [*g_plus, *g_minus], lam)
    n = len(lam)
    diff = torch._foreach_sub(both[:n], both[n:])
    torch._foreach_div_(diff, sign * 2 * eps)
    return list(diff)


def sama(outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
         hparams: HparamsLike, config: SamaConfig | None = None, *,
         grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
    """gF_lam - M.(P v) at the current ``params`` (module docstring)."""
    cfg = config or SamaConfig()
    theta, spec = _flat(params)
    lam = fast_space.hparams_of(hparams)
    v, direct = outer_grads(outer_loss_fn, theta, spec, lam, grad_sync)
    v = scaled(v, fast_space.laid_out(cfg.scale, spec))
    with fast_space.over(spec):
        zero = _norm(v) == 0
    if zero:
        return tuple(d.detach() for d in direct)
    mixed = mixed_fd(inner_loss_fn, theta, spec, lam, v, cfg.r, grad_sync)
    return tuple((d - m).detach() for d, m in zip(direct, mixed, strict=True))


def _samples(out: Any, which: str) -> tuple[Tensor, Tensor]:
    if not isinstance(out, Mapping) or "losses" not in out or "log_prob" not in out:
        raise TypeError(f"reinforce: the {which} inner loss must return a mapping with "
                        "'losses' (each sample's loss, shape (B,)) and 'log_prob' (each "
                        "sample's log-probability under the hyperparameters' distribution), "
                        f"got {type(out).__name__}")
    losses, log_prob = out["losses"], out["log_prob"]
    if losses.shape != log_prob.shape or losses.dim() != 1:
        raise ValueError(f"reinforce: 'losses' {tuple(losses.shape)} and 'log_prob' "
                         f"{tuple(log_prob.shape)} must both have shape (B,)")
    return losses, log_prob


def reinforce(outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
              hparams: HparamsLike, config: ReinforceConfig | None = None, *,
              grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
    """gF_lam - xi * (score-function estimate of M.v) at the current ``params``."""
    cfg = config or ReinforceConfig()
    theta, spec = _flat(params)
    lam = fast_space.hparams_of(hparams)
    v, direct = outer_grads(outer_loss_fn, theta, spec, lam, grad_sync)
    score = reinforce_product(inner_loss_fn, theta, spec, lam, v, cfg, grad_sync)
    return tuple((g - s).detach() for g, s in zip(direct, score, strict=True))


def reinforce_product(inner_loss_fn: LossFn, theta: list[Tensor], spec: Any,
                      lam: Hparams, v: Sequence[Tensor], cfg: ReinforceConfig,
                      grad_sync: GradSync | None) -> list[Tensor]:
    """xi * (score-function estimate of M.v) at ``theta``."""
    with fast_space.over(spec):
        norm = _norm(v)
    if norm == 0 or cfg.xi == 0:
        return [t.new_zeros(t.shape) for t in lam]
    eps = cfg.r / (norm + _TINY)
    plus, minus = _shifted(theta, v, eps)
    with torch.no_grad():
        l_plus, _ = _samples(inner_loss_fn(tree_unflatten(plus, spec), lam.tree()), "shifted")
        l_minus, _ = _samples(inner_loss_fn(tree_unflatten(minus, spec), lam.tree()), "shifted")
    d = (l_plus - l_minus) / (2 * eps)
    _, log_prob = _samples(inner_loss_fn(tree_unflatten(theta, spec), lam.tree()), "current")
    score = fast_space.sync_lam(grad_sync, _grad((d.detach() * log_prob).mean(), lam), lam)
    return [cfg.xi * s for s in score]
