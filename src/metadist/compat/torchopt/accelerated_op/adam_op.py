"""TorchOpt's ``AdamOp`` as its pure-Python fallback computes it (no compiled kernel here):
``(mu, nu, updates, count) -> (new_mu, new_nu, new_updates)``, Adam's moments and step."""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["AdamOp"]


class AdamOp:
    """One Adam step for one tensor; ``inplace`` writes into ``mu``, ``nu`` and ``updates``."""

    def __init__(self, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                 eps_root: float = 0.0, inplace: bool = True) -> None:
        self.b1, self.b2, self.eps, self.eps_root, self.inplace = b1, b2, eps, eps_root, inplace

    def __call__(self, mu: Tensor, nu: Tensor, updates: Tensor | None, count: Any
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
        if updates is None:
            return mu, nu, None
        b1, b2 = self.b1, self.b2
        new_mu = mu.mul(b1).add_(updates, alpha=1.0 - b1)
        new_nu = nu.mul(b2).addcmul_(updates, updates, value=1.0 - b2)
        step = new_mu.div(1.0 - pow(b1, count)).div_(
            new_nu.div(1.0 - pow(b2, count)).add_(self.eps_root).sqrt_().add_(self.eps))
        if self.inplace:
            return mu.copy_(new_mu), nu.copy_(new_nu), updates.copy_(step)
        return new_mu, new_nu, step
