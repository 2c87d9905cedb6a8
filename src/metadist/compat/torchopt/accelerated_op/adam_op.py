"""TorchOpt's ``AdamOp`` with TorchOpt's numbers: ``(mu, nu, updates, count) -> (new_mu,
new_nu, new_updates)``, differentiated by TorchOpt's hand-written backward.

[Note: TorchOpt's backward, not the exact derivative]
TorchOpt 0.7.3 differentiates its fused Adam step with formulas of its own rather than
through autograd: the step's gradient with respect to the second moment carries the first
moment's bias correction where the exact derivative has the second's, and elements whose
first moment is zero get no gradient. A meta-gradient through ``use_accelerated_op=True``
therefore differs from the exact one in the last digits, and programs compared with TorchOpt
expect TorchOpt's. Its compiled kernels do not load with this torch (they were built against
an older one), so TorchOpt runs its Python implementation of them; each operation here is
that implementation's, in its order, so the numbers are equal bit for bit. The exact
derivative is what ``use_accelerated_op=False`` computes (autograd through the same Adam).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["AdamOp", "MuOp", "NuOp", "UpdatesOp"]


def _moment1(updates: Tensor, mu: Tensor, b1: float) -> Tensor:
    return mu.mul(b1).add_(updates, alpha=1.0 - b1)


def _moment2(updates: Tensor, nu: Tensor, b2: float) -> Tensor:
    return nu.mul(b2).addcmul_(updates, updates, value=1.0 - b2)


def _step(mu: Tensor, nu: Tensor, b1: float, b2: float, eps: float, eps_root: float,
          count: Any) -> Tensor:
    return mu.div(1.0 - pow(b1, count)).div_(
        nu.div(1.0 - pow(b2, count)).add_(eps_root).sqrt_().add_(eps))


class MuOp(torch.autograd.Function):
    """The first moment."""

    @staticmethod
    def forward(ctx: Any, updates: Tensor, mu: Tensor, b1: float) -> Tensor:
        ctx.save_for_backward(updates, mu)  # what TorchOpt's saves (torchopt.visual draws it)
        ctx.b1 = b1
        return _moment1(updates, mu, b1)

    @staticmethod
    def backward(ctx: Any, dmu: Tensor) -> tuple[Tensor, Tensor, None]:
        return dmu.mul(1.0 - ctx.b1), dmu.mul(ctx.b1), None


class NuOp(torch.autograd.Function):
    """The second moment."""

    @staticmethod
    def forward(ctx: Any, updates: Tensor, nu: Tensor, b2: float) -> Tensor:
        ctx.save_for_backward(updates, nu)
        ctx.b2 = b2
        return _moment2(updates, nu, b2)

    @staticmethod
    def backward(ctx: Any, dnu: Tensor) -> tuple[Tensor, Tensor, None]:
        updates, _ = ctx.saved_tensors
        return updates.mul(dnu).mul_(2.0 * (1.0 - ctx.b2)), dnu.mul(ctx.b2), None


class UpdatesOp(torch.autograd.Function):
    """The step from the moments, with TorchOpt's backward (see the module notes)."""

    @staticmethod
    def forward(ctx: Any, mu: Tensor, nu: Tensor, others: tuple[Any, ...]) -> Tensor:
        out = _step(mu, nu, *others)
        ctx.save_for_backward(out, mu, nu)
        ctx.others = others
        return out

    @staticmethod
    def backward(ctx: Any, dupdates: Tensor) -> tuple[Tensor, Tensor, None]:
        updates, mu, _ = ctx.saved_tensors
        b1, b2, _, eps_root, count = ctx.others
        bias1 = 1.0 - pow(b1, count)
        inv_bias2 = 1.0 / (1.0 - pow(b2, count) + eps_root)
        ratio = updates.div(mu)
        dmu = dupdates.mul(ratio)
        dnu = ratio.mul_(bias1).square_().mul_(dupdates).mul_(updates).mul_(-0.5 * inv_bias2)
        zero = mu == 0
        dmu[zero] = 0
        dnu[zero] = 0
        return dmu, dnu, None


class AdamOp:
    """One Adam step for one tensor; ``inplace`` writes into ``mu``, ``nu`` and ``updates``
    (no graph), otherwise the step is differentiable with TorchOpt's backward."""

    # (autograd names their nodes MuOpBackward, NuOpBackward, UpdatesOpBackward, as
    # TorchOpt's: torchopt.visual draws the same graph)
    MuOp = MuOp
    NuOp = NuOp
    UpdatesOp = UpdatesOp

    def __init__(self, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                 eps_root: float = 0.0, inplace: bool = True) -> None:
        self.b1, self.b2, self.eps, self.eps_root, self.inplace = b1, b2, eps, eps_root, inplace

    def __call__(self, mu: Tensor, nu: Tensor, updates: Tensor | None, count: Any
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
        if updates is None:
            return mu, nu, None
        if self.inplace:
            mu = mu.mul_(self.b1).add_(updates, alpha=1.0 - self.b1)
            nu = nu.mul_(self.b2).addcmul_(updates, updates, value=1.0 - self.b2)
            updates.copy_(_step(mu, nu, self.b1, self.b2, self.eps, self.eps_root, count))
            return mu, nu, updates
        new_mu = MuOp.apply(updates, mu, self.b1)
        new_nu = NuOp.apply(updates, nu, self.b2)
        step = UpdatesOp.apply(new_mu, new_nu,
                                (self.b1, self.b2, self.eps, self.eps_root, count))
        return new_mu, new_nu, step
