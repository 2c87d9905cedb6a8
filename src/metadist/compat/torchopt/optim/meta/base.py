"""TorchOpt's ``MetaOptimizer(module, impl)``: differentiable steps of a module's parameters,
written back into its parameter containers (so the next forward uses them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from metadist.compat.torchopt.base import GradientTransformation, UninitializedState
from metadist.compat.torchopt.optim.base import check_impl
from metadist.compat.torchopt.update import apply_updates
from metadist.compat.torchopt.utils import extract_module_containers
from metadist.strategies.bind import write

__all__ = ["MetaOptimizer"]


class MetaOptimizer:
    """Differentiable optimiser over ``module``'s parameters."""

    def __init__(self, module: nn.Module, impl: GradientTransformation) -> None:
        self.impl = check_impl(impl)
        self.param_containers_groups: list[tuple[dict[str, Any], ...]] = []
        self.state_groups: list[Any] = []
        self.add_param_group(module)

    def step(self, loss: Tensor) -> None:
        """Gradients of ``loss`` with the graph kept, one update, the new tensors written into
        the module's containers."""
        for i, containers in enumerate(self.param_containers_groups):
            keys = [(c, k) for c in containers for k, v in c.items() if v is not None]
            flat = tuple(c[k] for c, k in keys)
            state = self.state_groups[i]
            if isinstance(state, UninitializedState):
                state = self.impl.init(flat)
            grads = torch.autograd.grad(loss, flat, create_graph=True, allow_unused=True)
            updates, self.state_groups[i] = self.impl.update(grads, state, params=flat,
                                                             inplace=False)
            # each (container, key) is a place of strategies/bind.py: written and kept
            write(zip(keys, apply_updates(flat, updates, inplace=False), strict=True))

    def add_param_group(self, module: nn.Module) -> None:
        self.param_containers_groups.append(extract_module_containers(module,
                                                                      with_buffers=False)[0])
        self.state_groups.append(UninitializedState())

    def state_dict(self) -> tuple[Any, ...]:
        return tuple(self.state_groups)

    def load_state_dict(self, state_dict: Sequence[Any]) -> None:
        self.state_groups[:] = list(state_dict)
