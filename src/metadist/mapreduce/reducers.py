"""Reducers: turn the list of part results (in partition order) into one value.

Any callable taking that list works; without one, the caller gets the list itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _stack(results: Iterable[torch.Tensor], name: str) -> torch.Tensor:
    items = tuple(results)
    if not items:
        raise ValueError(f"{name} got no results: the partitioner made no parts (an empty "
                         "batch?); check the inputs or pass a reducer that accepts []")
    bad = [type(r).__name__ for r in items if not isinstance(r, torch.Tensor)]
    if bad:
        raise TypeError(f"{name} reduces tensors but the parts returned {', '.join(set(bad))}; "
                        "return a tensor from the function or pass your own reducer")
    return torch.stack(items, dim=0)


def mean_reducer(results: Iterable[torch.Tensor]) -> torch.Tensor:
    """Element-wise mean of the part results (same shapes)."""
    return _stack(results, "mean_reducer").mean(dim=0)


def sum_reducer(results: Iterable[torch.Tensor]) -> torch.Tensor:
    """Element-wise sum of the part results (same shapes)."""
    return _stack(results, "sum_reducer").sum(dim=0)


__all__ = ["mean_reducer", "sum_reducer"]
