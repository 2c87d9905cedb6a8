"""Pytree walks on the hot path of every call, fast for plain tuples, lists and dicts.

torch's pytree visits ~20 us per node in Python; a map-reduce call walks every part's
arguments and results several times, so plain containers and common leaves are handled here
directly, in torch's order, and anything else (namedtuples, registered nodes) goes to torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

_ATOMS = (torch.Tensor, nn.Module, int, float, complex, str, bytes, bool, type(None))
_is_leaf: Callable[[Any], bool] = getattr(pytree, "tree_is_leaf", None) or pytree._is_leaf
_leaf_types: dict[type, bool] = {}  # whether torch's pytree treats instances as leaves


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)`` (torch's leaf order)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind(tree_map(fn, item) for item in tree)
    if kind is dict:
        return {key: tree_map(fn, value) for key, value in tree.items()}
    if isinstance(tree, _ATOMS):
        return fn(tree)
    leaf = _leaf_types.get(kind)
    if leaf is None:
        leaf = _leaf_types[kind] = bool(_is_leaf(tree))
    return fn(tree) if leaf else pytree.tree_map(fn, tree)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in the order :func:`tree_map` visits them."""
    out: list[Any] = []
    tree_map(out.append, tree)
    return out


def refill(tree: Any, new_leaves: list[Any]) -> Any:
    """``tree`` with its leaves replaced, in order, by ``new_leaves``."""
    it: Iterator[Any] = iter(new_leaves)
    return tree_map(lambda _: next(it), tree)


__all__ = ["leaves", "refill", "tree_map"]
