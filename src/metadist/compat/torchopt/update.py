"""TorchOpt's ``apply_updates``: in place by default (metadist's own is out of place)."""

from __future__ import annotations

from typing import Any

import torch

from metadist.compat.torchopt import _tree

__all__ = ["apply_updates"]


def apply_updates(params: Any, updates: Any, *, inplace: bool = True) -> Any:
    """``params + updates`` leaf by leaf (a ``None`` update leaves its parameter alone);
    ``inplace=True`` adds into ``p.data`` and returns ``params``."""
    def add(p: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        if u is None:
            return p
        if inplace:
            p.data.add_(u)
            return p
        return p.add(u)

    return _tree.tree_map(add, params, updates)
