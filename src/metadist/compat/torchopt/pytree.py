"""TorchOpt's ``torchopt.pytree``: optree's tree functions and TorchOpt's arithmetic over
trees of tensors.

This module needs optree (``pip install optree``), as TorchOpt's does: it is the one part of
the drop-in that does, so that ``import metadist.compat.torchopt`` and every optimiser work
without it (they flatten with torch's own pytree). Programs that use ``torchopt.pytree`` get
optree's exact semantics (``none_is_leaf``, namespaces, ``PyTreeSpec``), which torch's pytree
does not reproduce.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

try:
    import optree
    from optree import *  # noqa: F403
except ImportError as e:  # pragma: no cover - optree is an optional dependency
    raise ImportError("torchopt.pytree (metadist.compat.torchopt.pytree) needs optree, as "
                      "TorchOpt's does: pip install optree") from e

__all__ = [*optree.__all__,  # noqa: PLE0604
           "tree_add", "tree_add_scalar_mul", "tree_flatten_as_tuple",
           "tree_matmul", "tree_mul", "tree_neg", "tree_pos", "tree_scalar_mul", "tree_sub",
           "tree_sub_scalar_mul", "tree_truediv", "tree_vdot_real", "tree_wait"]

_map = optree.tree_map


def tree_flatten_as_tuple(tree: Any, is_leaf: Callable[[Any], bool] | None = None, *,
                          none_is_leaf: bool = False, namespace: str = "") -> tuple[Any, Any]:
    """``tree_flatten`` with the leaves as a tuple."""
    flat, spec = optree.tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf,
                                     namespace=namespace)
    return tuple(flat), spec


def acc_add(*args: Any) -> Any:
    return functools.reduce(operator.add, args)


def acc_mul(*args: Any) -> Any:
    return functools.reduce(operator.mul, args)


def acc_matmul(*args: Any) -> Any:
    return functools.reduce(operator.matmul, args)


def tree_pos(tree: Any) -> Any:
    return _map(operator.pos, tree)


def tree_neg(tree: Any) -> Any:
    return _map(operator.neg, tree)


def tree_add(*trees: Any) -> Any:
    return _map(acc_add, *trees)


def tree_add_scalar_mul(tree_x: Any, tree_y: Any, alpha: Any = None) -> Any:
    """``x + alpha * y`` leaf by leaf."""
    if alpha is None:
        return _map(lambda x, y: x.add(y), tree_x, tree_y)
    return _map(lambda x, y: x.add(y, alpha=alpha), tree_x, tree_y)


def tree_sub(minuend_tree: Any, subtrahend_tree: Any) -> Any:
    return _map(operator.sub, minuend_tree, subtrahend_tree)


def tree_sub_scalar_mul(tree_x: Any, tree_y: Any, alpha: Any = None) -> Any:
    """``x - alpha * y`` leaf by leaf."""
    if alpha is None:
        return _map(lambda x, y: x.sub(y), tree_x, tree_y)
    return _map(lambda x, y: x.sub(y, alpha=alpha), tree_x, tree_y)


def tree_mul(*trees: Any) -> Any:
    return _map(acc_mul, *trees)


def tree_matmul(*trees: Any) -> Any:
    return _map(acc_matmul, *trees)


def tree_scalar_mul(scalar: Any, multiplicand_tree: Any) -> Any:
    return _map(lambda x: scalar * x, multiplicand_tree)


def tree_truediv(dividend_tree: Any, divisor_tree: Any) -> Any:
    return _map(operator.truediv, dividend_tree, divisor_tree)


def _vdot_real(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.contiguous().view(-1), y.contiguous().view(-1)
    dot = torch.dot(x.real, y.real).item()
    if x.is_complex() and y.is_complex():
        dot += torch.dot(x.imag, y.imag).item()
    return dot


def tree_vdot_real(tree_x: Any, tree_y: Any) -> float:
    """``sum(dot(x.conj(), y).real)`` over the leaves."""
    xs, spec = optree.tree_flatten(tree_x)
    return sum(map(_vdot_real, xs, spec.flatten_up_to(tree_y)))


def tree_wait(future_tree: Any) -> Any:
    """A tree of futures -> the tree of their results."""
    futures, spec = optree.tree_flatten(future_tree)
    return optree.tree_unflatten(spec, torch.futures.wait_all(futures))


if torch.distributed.rpc.is_available():
    def tree_as_rref(tree: Any) -> Any:
        from torch.distributed.rpc import RRef

        return _map(RRef, tree)

    def tree_to_here(rref_tree: Any, timeout: float = 0.0) -> Any:
        if timeout:
            return _map(lambda x: x.to_here(timeout=timeout), rref_tree)
        return _map(lambda x: x.to_here(), rref_tree)

    def tree_local_value(rref_tree: Any) -> Any:
        return _map(lambda x: x.local_value(), rref_tree)

    __all__ += ["tree_as_rref", "tree_to_here"]
