"""TorchOpt's functional optimiser: ``new_params = FuncOptimizer(impl).step(loss, params)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from metadist.compat.torchopt.base import GradientTransformation, UninitializedState
from metadist.compat.torchopt.optim.base import check_impl
from metadist.compat.torchopt.update import apply_updates

__all__ = ["FuncOptimizer"]


class FuncOptimizer:
    """Differentiable steps of a tuple of parameters (the graph through the step kept)."""

    def __init__(self, impl: GradientTransformation, *, inplace: bool = False) -> None:
        self.impl = check_impl(impl)
        self.optim_state: Any = UninitializedState()
        self.inplace = bool(inplace)

    def step(self, loss: Tensor, params: Any, inplace: bool | None = None) -> Any:
        if isinstance(self.optim_state, UninitializedState):
            self.optim_state = self.impl.init(params)
        inplace = self.inplace if inplace is None else inplace
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        updates, self.optim_state = self.impl.update(grads, self.optim_state, params=params,
                                                     inplace=inplace)
        return apply_updates(params, updates, inplace=inplace)

    def state_dict(self) -> Any:
        return self.optim_state

    def load_state_dict(self, state_dict: Any) -> None:
        self.optim_state = state_dict
