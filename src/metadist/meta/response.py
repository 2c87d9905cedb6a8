"""The response product of one level: -M.A.v for a vector v in the inner parameters' space,
the inner loss G(theta, lam) and a method's approximation A of the inverse inner Hessian.

It is what a hypergradient path carries from one level to the next (the engine's links
after the first, Betty's per-level products): each method of :mod:`metadist.meta.hypergrad`
applied to the linear outer loss <theta, v> returns exactly this, and :func:`response`
computes it without that detour. Every data-dependent product is synced by ``grad_sync``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from metadist.meta.directional import (
    ReinforceConfig,
    SamaConfig,
    mixed_fd,
    reinforce_product,
    scaled,
)
from metadist.meta.hypergrad import (
    CGConfig,
    DartsConfig,
    HypergradConfig,
    LossFn,
    NeumannConfig,
    Solve,
    _prepare,
    cg_solve,
    hypergradient,
    implicit_product,
    neumann_solve,
)
from metadist.meta.optim import GradSync


def response(method: str, v: Sequence[Tensor], inner_loss_fn: LossFn, params: Any,
             hparams: Sequence[Tensor] | Tensor, config: HypergradConfig | None = None, *,
             grad_sync: GradSync | None = None, solve: Solve | None = None
             ) -> tuple[Tensor, ...]:
    """-M.A.v at ``params`` (``v`` ordered as ``params``' leaves), one tensor per hparam.
    ``solve`` replaces an implicit method's inverse-Hessian solve (e.g. another library's
    conjugate gradient)."""
    theta, spec, lam = _prepare(params, hparams)
    vec = [t.detach() for t in v]
    match method:
        case "neumann" | "cg":
            if solve is None:
                solve = (neumann_solve(config if isinstance(config, NeumannConfig)
                                       else NeumannConfig()) if method == "neumann"
                         else cg_solve(config if isinstance(config, CGConfig) else CGConfig()))
            m = implicit_product(vec, inner_loss_fn, theta, spec, lam, grad_sync, solve)
            return tuple(-x.detach() for x in m)
        case "sama":
            cfg = config if isinstance(config, SamaConfig) else SamaConfig()
            return tuple(mixed_fd(inner_loss_fn, theta, spec, lam, scaled(vec, cfg.scale),
                                  cfg.r, grad_sync, sign=-1.0))
        case "darts":
            darts = config if isinstance(config, DartsConfig) else DartsConfig()
            if darts.first_order or darts.xi == 0:
                return tuple(t.new_zeros(t.shape) for t in lam)
            return tuple(mixed_fd(inner_loss_fn, theta, spec, lam, vec, darts.r, grad_sync,
                                  sign=-darts.xi))
        case "reinforce":
            rcfg = config if isinstance(config, ReinforceConfig) else ReinforceConfig()
            score = reinforce_product(inner_loss_fn, theta, spec, lam, vec, rcfg, grad_sync)
            return tuple(-x.detach() for x in score)
    # unrolled: through the replayed steps, on the linear loss <theta, v>
    return hypergradient(method, _linear(vec), inner_loss_fn, params, hparams, config,
                         grad_sync=grad_sync)


def _linear(v: list[Tensor]) -> LossFn:
    def outer(theta: Any, lam: tuple[Tensor, ...]) -> Tensor:
        flat = list(theta.values()) if isinstance(theta, dict) else list(theta)
        total: Tensor = (flat[0] * v[0]).sum()
        for t, w in zip(flat[1:], v[1:], strict=True):
            total = total + (t * w).sum()
        return total

    return outer
