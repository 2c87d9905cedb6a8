"""TorchOpt's ``torchopt.linear_solve``: linear solvers ``solver(matvec, b) -> x`` for implicit
differentiation (``custom_root(..., solve=...)``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import func

from metadist.compat.torchopt import _tree, linalg

__all__ = ["solve_cg", "solve_inv", "solve_normal_cg"]

Matvec = Callable[[Any], Any]


def _ridge(matvec: Matvec, ridge: float | None) -> Matvec:
    if ridge is None:
        return matvec
    return lambda y: _tree.tree_map(lambda a, b: a.add(b, alpha=ridge), matvec(y), y)


def _solve_cg(matvec: Matvec, b: Any, ridge: float | None = None, init: Any = None,
              **kwargs: Any) -> Any:
    return linalg.cg(_ridge(matvec, ridge), b, x0=init, **kwargs)


def solve_cg(**kwargs: Any) -> Callable[..., Any]:
    """Conjugate gradient (``matvec`` positive definite); ``ridge`` adds ``ridge * I``, the
    other keywords go to :func:`linalg.cg`."""
    return functools.partial(_solve_cg, **kwargs)


def _solve_normal_cg(matvec: Matvec, b: Any, ridge: float | None = None, init: Any = None,
                     **kwargs: Any) -> Any:
    example = b if init is None else init
    rmatvec = func.vjp(matvec, example)[1]

    def normal(y: Any) -> Any:
        out, vjp = func.vjp(matvec, y)  # type: ignore[misc]
        return vjp(out)[0]

    return linalg.cg(_ridge(normal, ridge), rmatvec(b)[0], x0=init, **kwargs)


def solve_normal_cg(**kwargs: Any) -> Callable[..., Any]:
    """Conjugate gradient on the normal equations ``A^T A x = A^T b`` (any invertible A)."""
    return functools.partial(_solve_normal_cg, **kwargs)


def _solve_inv(matvec: Matvec, b: Any, ridge: float | None = None, ns: bool = False,
               **kwargs: Any) -> Any:
    matvec = _ridge(matvec, ridge)
    leaves, spec = _tree.flatten(b)
    if len(leaves) == 1 and leaves[0].ndim == 0:
        a = func.jacfwd(matvec)(b)
        return _tree.tree_map(lambda x, y: x / y, b, a)
    if ns:
        return linalg.ns(matvec, b, **kwargs)
    shapes = [t.shape for t in leaves]

    def flat_matvec(vs: list[torch.Tensor]) -> list[torch.Tensor]:
        xs = _tree.unflatten(spec, [v.reshape(s) for v, s in zip(vs, shapes, strict=True)])
        return [t.reshape(-1) for t in _tree.leaves(matvec(xs))]

    flat_b = [t.reshape(-1) for t in leaves]
    jac = func.jacfwd(flat_matvec)(flat_b)
    n = len(flat_b)
    # TorchOpt's materialisation: each leaf solved with its own diagonal block of the Jacobian
    out = [torch.linalg.solve(jac[i][i], flat_b[i]).reshape(shapes[i]) for i in range(n)]
    return _tree.unflatten(spec, out)


def solve_inv(**kwargs: Any) -> Callable[..., Any]:
    """Solve by materialising the operator and inverting it (``ns=True``: a Neumann series
    instead, keywords to :func:`linalg.ns`)."""
    return functools.partial(_solve_inv, **kwargs)
