"""Tree helpers of the compat layer on torch's own pytree (the package does not need optree;
:mod:`metadist.compat.torchopt.pytree`, TorchOpt's optree-based module, does).

``None`` follows TorchOpt's rule for ``tree_map(f, tree, *rest)``: a ``None`` in ``tree`` is
an empty node (kept as ``None`` in the result, ``f`` not called) unless ``none_is_leaf``; a
``None`` in ``rest`` opposite a leaf of ``tree`` is passed to ``f``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch.utils import _pytree as tp


class MaskedNode(NamedTuple):
    """Stands where ``masked`` hid a leaf: a tree map sees no leaf there (an empty node), and
    a map over flattened leaves passes it through (TorchOpt 0.7.3's flattened chains call the
    inner function on it and fail: ``adamw(mask=...)``)."""


def _none_leaf(x: Any) -> bool:
    return x is None


def leaves(tree: Any, none_is_leaf: bool = False) -> list[Any]:
    flat = tp.tree_flatten(tree, is_leaf=_none_leaf)[0]
    return flat if none_is_leaf else [x for x in flat if x is not None]


def flatten(tree: Any) -> tuple[list[Any], tp.TreeSpec]:
    """Leaves with ``None`` as a leaf, and the structure to rebuild ``tree``."""
    return tp.tree_flatten(tree, is_leaf=_none_leaf)


def unflatten(spec: tp.TreeSpec, flat: Sequence[Any]) -> Any:
    return tp.tree_unflatten(list(flat), spec)


def tree_map(f: Callable[..., Any], tree: Any, *rest: Any, none_is_leaf: bool = False) -> Any:
    flat, spec = flatten(tree)
    # the other trees flattened up to ``tree``'s structure: where ``tree`` has a leaf, ``f``
    # gets whatever they hold there (a None, a masked-out node), as optree's prefix rule
    others = [spec.flatten_up_to(r) for r in rest]
    out = [None if x is None and not none_is_leaf else f(x, *xs)
           for x, *xs in zip(flat, *others, strict=True)]
    return unflatten(spec, out)


def tree_map_(f: Callable[..., Any], tree: Any, *rest: Any, none_is_leaf: bool = False) -> Any:
    """:func:`tree_map` for ``f``'s side effects; returns ``tree``."""
    tree_map(f, tree, *rest, none_is_leaf=none_is_leaf)
    return tree


def map_flat(f: Callable[..., Any], flat: Sequence[Any], *flats: Any,
             none_is_leaf: bool = False) -> Sequence[Any]:
    """``f`` over flat sequences, a sequence of ``flat``'s type back (``None``: as above)."""
    def g(x: Any, *xs: Any) -> Any:
        if isinstance(x, MaskedNode):
            return x
        return None if x is None and not none_is_leaf else f(x, *xs)
    return flat.__class__(map(g, flat, *flats))  # type: ignore[call-arg]


def map_flat_(f: Callable[..., Any], flat: Sequence[Any], *flats: Any,
              none_is_leaf: bool = False) -> Sequence[Any]:
    def g(x: Any, *xs: Any) -> Any:
        if isinstance(x, MaskedNode):
            return x
        return None if x is None and not none_is_leaf else f(x, *xs)
    deque(map(g, flat, *flats), maxlen=0)
    return flat


def mappers(flat: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(tree_map, tree_map_)`` over trees, or over already flattened sequences."""
    return (map_flat, map_flat_) if flat else (tree_map, tree_map_)
