"""TorchOpt's torch-style ``Optimizer(params, impl)``: ``zero_grad()``, ``loss.backward()``,
``step()`` update the parameters in place; parameters without a gradient are left alone."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.base import GradientTransformation, UninitializedState
from metadist.compat.torchopt.update import apply_updates

__all__ = ["Optimizer"]


def check_impl(impl: Any) -> GradientTransformation:
    if not isinstance(impl, GradientTransformation):
        raise TypeError(f"{impl} (type: {type(impl).__name__}) is not a GradientTransformation")
    return impl


class Optimizer:
    """In-place optimiser over ``params`` with the gradient transformation ``impl``."""

    def __init__(self, params: Iterable[Tensor], impl: GradientTransformation) -> None:
        self.impl = check_impl(impl)
        self.param_groups: list[tuple[Tensor, ...]] = []
        self.param_treespecs: list[Any] = []
        self.state_groups: list[Any] = []
        if not isinstance(params, list | tuple):
            params = tuple(params)
        self.add_param_group(params)

    def zero_grad(self, set_to_none: bool = False) -> None:
        for group in self.param_groups:
            for p in group:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_dict(self) -> tuple[Any, ...]:
        return tuple(self.state_groups)

    def load_state_dict(self, state_dict: Sequence[Any]) -> None:
        self.state_groups[:] = list(state_dict)

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, (params, held) in enumerate(zip(self.param_groups, self.state_groups,
                                               strict=True)):
            state = self.impl.init(params) if isinstance(held, UninitializedState) else held
            grads = tuple(p.grad for p in params)
            updates, self.state_groups[i] = self.impl.update(grads, state, params=params,
                                                             inplace=True)
            self.param_groups[i] = apply_updates(params, updates, inplace=True)
        return loss

    def add_param_group(self, params: Any) -> None:
        flat, spec = _tree.flatten(params)
        self.param_groups.append(tuple(t for t in flat if t is not None))
        self.param_treespecs.append(spec)
        self.state_groups.append(UninitializedState())
