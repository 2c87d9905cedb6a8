"""TorchOpt's ``torchopt.linalg.utils``: matrices (a tree of square ones) as linear operators."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from metadist.compat.torchopt import _tree

__all__ = ["cat_shapes", "normalize_matvec"]


def cat_shapes(tree: Any) -> tuple[int, ...]:
    """The leaves' shapes, concatenated."""
    return tuple(itertools.chain.from_iterable(t.shape for t in _tree.leaves(tree)))


def normalize_matvec(matvec: Any) -> Callable[[Any], Any]:
    """``matvec`` if callable; else ``x -> [A_i @ x_i]`` over a tree of square matrices."""
    if callable(matvec):
        return matvec  # type: ignore[no-any-return]
    mats, spec = _tree.flatten(matvec)
    for m in mats:
        if not isinstance(m, torch.Tensor) or m.ndim != 2 or m.shape[0] != m.shape[1]:
            shape = getattr(m, "shape", None)
            raise TypeError(f"Linear operator must be a square matrix, but has shape: {shape}")

    def apply(x: Any) -> Any:
        xs = _tree.leaves(x)
        if len(xs) != len(mats):
            raise ValueError(f"`x` must have the same number of leaves as `matvec`, but has "
                             f"{len(xs)} leaves and `matvec` has {len(mats)} leaves")
        return _tree.unflatten(spec, [a @ v for a, v in zip(mats, xs, strict=True)])

    return apply
