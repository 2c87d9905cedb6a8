"""TorchOpt's ``torchopt.transform.utils``: leafwise maps over flattened sequences, the step
counter and the moving moments the scalers share. Each ``f`` has ``f.flat`` (on flattened
sequences) and ``f.impl`` (``already_flattened=`` keyword), as TorchOpt's."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt._tree import map_flat as tree_map_flat
from metadist.compat.torchopt._tree import map_flat_ as tree_map_flat_

__all__ = ["inc_count", "tree_map_flat", "tree_map_flat_", "update_moment"]

INT64_MAX = torch.iinfo(torch.int64).max


def put(target: Tensor, value: Tensor, inplace: bool) -> Tensor:
    """``value``, written into ``target`` when ``inplace`` (the same arithmetic either way)."""
    if not inplace:
        return value
    return target.copy_(value)


def variants(impl: Callable[..., Any]) -> Any:
    """The public function for ``impl(..., already_flattened=...)``, with ``.flat`` and
    ``.impl`` attached."""
    def public(*args: Any, **kwargs: Any) -> Any:
        return impl(*args, already_flattened=False, **kwargs)

    def flat(*args: Any, **kwargs: Any) -> Any:
        return impl(*args, already_flattened=True, **kwargs)

    sig = inspect.signature(impl)
    public.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[p for n, p in sig.parameters.items() if n != "already_flattened"])
    public.__name__ = public.__qualname__ = impl.__name__.lstrip("_")
    public.__doc__ = impl.__doc__
    flat.__name__ = flat.__qualname__ = impl.__name__ + "_flat"
    public.flat = flat  # type: ignore[attr-defined]
    public.impl = impl  # type: ignore[attr-defined]
    return public


def _inc_count(updates: Any, count: Any, *, already_flattened: bool = False) -> Any:
    """Every counter whose update is not ``None`` plus one (saturating at int64's maximum)."""
    def f(c: Tensor, g: Tensor | None) -> Tensor:
        return c + (c != INT64_MAX).to(torch.int64) if g is not None else c

    tree_map = _tree.mappers(already_flattened)[0]
    return tree_map(f, count, updates, none_is_leaf=True)


def _update_moment(updates: Any, moments: Any, decay: float, *, order: int,
                   inplace: bool = True, already_flattened: bool = False) -> Any:
    """``decay * moment + (1 - decay) * update**order`` leaf by leaf (``decay == 1``: a plain
    sum); ``None`` updates leave their moments as they are."""
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order}")

    def f(g: Tensor | None, t: Tensor) -> Tensor:
        if g is None:
            return t
        scaled = t if decay == 1.0 else t.mul(decay)
        if order == 2:
            new = scaled.addcmul(g, g) if decay == 1.0 else scaled.addcmul(g, g, value=1 - decay)
        else:
            new = scaled.add(g) if decay == 1.0 else scaled.add(g, alpha=1 - decay)
        return put(t, new, inplace)

    tree_map = _tree.mappers(already_flattened)[0]
    return tree_map(f, updates, moments, none_is_leaf=True)


inc_count = variants(_inc_count)
update_moment = variants(_update_moment)
