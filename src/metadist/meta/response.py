"""The response product of one level: -M.A.v for a vector v in the inner parameters' space,
the inner loss G(theta, lam) and a method's approximation A of the inverse inner Hessian.

It is what a hypergradient path carries from one level to the next (the engine's links
after the first, Betty's per-level products): each method of :mod:`metadist.meta.hypergrad`
applied to the linear outer loss <theta, v> returns exactly this, and each registered method
(meta/methods.py) computes it, most without that detour. Every data-dependent product is
synced by ``grad_sync``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from metadist.meta.fast_space import HparamsLike
from metadist.meta.hypergrad import HypergradConfig, LossFn
from metadist.meta.methods import Solve, hypergradient_method
from metadist.meta.optim import GradSync


def response(method: str, v: Sequence[Tensor], inner_loss_fn: LossFn, params: Any,
             hparams: HparamsLike, config: HypergradConfig | None = None, *,
             grad_sync: GradSync | None = None, solve: Solve | None = None
             ) -> tuple[Tensor, ...]:
    """-M.A.v at ``params`` (``v`` ordered as ``params``' leaves), one tensor per hparam.
    ``solve`` replaces an implicit method's inverse-Hessian solve (e.g. another library's
    conjugate gradient)."""
    return hypergradient_method(method).response(v, inner_loss_fn, params, hparams, config,
                                                 grad_sync=grad_sync, solve=solve)
