# ruff: noqa: N803 - TorchOpt's argument names (A, M)
"""TorchOpt's ``torchopt.linalg``: conjugate gradient (metadist's own solver,
:func:`metadist.meta.hypergrad.conjugate_gradient`, the one its implicit hypergradients use)
and Neumann-series solves and inverses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.linalg import utils
from metadist.compat.torchopt.linalg.utils import cat_shapes, normalize_matvec
from metadist.meta.hypergrad import conjugate_gradient

__all__ = ["cg", "ns", "ns_inv", "utils"]


def _flat_operator(op: Callable[[Any], Any], spec: Any) -> Callable[[list[Any]], list[Any]]:
    return lambda xs: _tree.leaves(op(_tree.unflatten(spec, xs)))


def cg(A: Any, b: Any, x0: Any = None, *, rtol: float = 1e-5, atol: float = 0.0,
       maxiter: int | None = None, M: Any = None) -> Any:
    """Solve ``A x = b`` (``A`` a positive definite operator or tree of matrices; ``M`` a
    preconditioner) by conjugate gradient; ``maxiter`` defaults to 10 times b's size."""
    bs, spec = _tree.flatten(b)
    if maxiter is None:
        maxiter = 10 * sum(cat_shapes(b))
    if x0 is not None and cat_shapes(x0) != cat_shapes(b):
        raise ValueError(f"Tensors in x0 and b must have matching shapes: {cat_shapes(x0)} vs. "
                         f"{cat_shapes(b)}.")
    x = conjugate_gradient(
        _flat_operator(normalize_matvec(A), spec), bs,
        None if x0 is None else _tree.leaves(x0), maxiter=maxiter, rtol=rtol, atol=atol,
        precond=None if M is None else _flat_operator(normalize_matvec(M), spec))
    return _tree.unflatten(spec, x)


def _ns_matrix(A: torch.Tensor, b: torch.Tensor, maxiter: int, alpha: float | None
               ) -> torch.Tensor:
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"`A` must be a square matrix, but has shape: {A.shape}")
    return ns(lambda v: A @ v, b, maxiter, alpha=alpha)  # type: ignore[no-any-return]


def ns(A: Any, b: Any, maxiter: int | None = None, *, alpha: float | None = None) -> Any:
    """inv(A) b by the Neumann series ``sum_k (I - A)^k b`` (``alpha``: of ``alpha A``, the
    sum scaled by ``alpha``), ``maxiter`` (10) terms after the first."""
    maxiter = 10 if maxiter is None else maxiter
    if not callable(A):
        return _tree.tree_map(lambda a, v: _ns_matrix(a, v, maxiter, alpha), A, b)
    scale = 1.0 if alpha is None else alpha
    total, term = b, b
    for _ in range(maxiter):
        term = _tree.tree_map(lambda t, h: t - scale * h if alpha is not None else t - h,
                              term, A(term))
        total = _tree.tree_map(lambda s, t: s + t, total, term)
    return total if alpha is None else _tree.tree_map(lambda s: alpha * s, total)


def _ns_inv_matrix(A: torch.Tensor, maxiter: int, alpha: float | None) -> torch.Tensor:
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"`A` must be a square matrix, but has shape: {A.shape}")
    eye = torch.eye(*A.shape, out=torch.empty_like(A))
    step = eye - (A if alpha is None else alpha * A)
    inv = torch.zeros_like(A)
    for k in range(maxiter):
        inv = inv + torch.linalg.matrix_power(step, k)
    return inv if alpha is None else alpha * inv


def ns_inv(A: Any, maxiter: int | None = None, *, alpha: float | None = None) -> Any:
    """inv(A) of each square matrix of ``A`` by a Neumann series of ``maxiter`` (10) terms."""
    maxiter = 10 if maxiter is None else maxiter
    return _tree.tree_map(lambda a: _ns_inv_matrix(a, maxiter, alpha), A)
