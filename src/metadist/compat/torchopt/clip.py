"""TorchOpt's ``clip_grad_norm`` transformation (torch's ``clip_grad_norm_`` rule)."""

from __future__ import annotations

from typing import Any

import torch

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.base import EmptyState, GradientTransformation
from metadist.compat.torchopt.transform.utils import put
from metadist.strategies.fast_weights import FastWeights
from metadist.strategies.tensors.shard_value import ShardValue

__all__ = ["clip_grad_norm"]

ClipState = EmptyState


def clip_grad_norm(max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> GradientTransformation:
    """Scale the updates by ``min(1, max_norm / (total_norm + 1e-6))``."""
    def init(params: Any) -> EmptyState:
        return ClipState()

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        present = _tree.leaves(updates)
        if not present:
            return updates, state
        device = present[0].device
        with torch.no_grad():
            if isinstance(updates, FastWeights):  # shards under zero3/hsdp: every rank's
                total = updates.norm(float(norm_type))
            elif any(isinstance(g, ShardValue) for g in present):  # zero3/hsdp gradients
                total = torch.nn.utils.get_total_norm(present, norm_type)  # across ranks
            elif norm_type == torch.inf:
                norms = [g.abs().max().to(device) for g in present]
                total = norms[0] if len(norms) == 1 else torch.max(torch.stack(norms))
            else:
                total = torch.norm(torch.stack([torch.norm(g, norm_type).to(device)
                                                for g in present]), norm_type)
            if error_if_nonfinite and (total.isnan() or total.isinf()):
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is "
                    "non-finite, so it cannot be clipped. To disable this error and scale the "
                    "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coefficient = min(max_norm / (float(total) + 1e-6), 1.0)
        return _tree.tree_map(lambda g: put(g, g.mul(coefficient), inplace), updates), state

    return GradientTransformation(init, update)
