"""Modules handed to a part: a structural copy whose parameters are substituted.

Both engines give a part a module of its own, as pickling does for an RPC: the part may
replace its parameters (a differentiable inner optimiser does) or update buffers (BatchNorm in
training mode) without touching the caller's module or another part's. The copy is shallow
(hooks and other attributes are shared) except for the parameter, buffer and child dicts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

TensorMap = Callable[[torch.Tensor], torch.Tensor]


def copy_module(module: nn.Module, params: TensorMap, buffers: TensorMap,
                memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """A copy of ``module`` whose parameters are ``params(p)`` and buffers ``buffers(b)``.

    Shared submodules stay shared within the copy (``memo``); substituted parameters are
    stored as plain tensors, which every forward reads like parameters.
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    # A shallow copy of the instance dict, without copy.copy's reduce/setstate round trip
    # (several times slower, and this runs for every part).
    new = object.__new__(type(module))
    state = new.__dict__
    state.update(module.__dict__)
    memo[id(module)] = new
    state["_parameters"] = {name: None if p is None else params(p)
                            for name, p in module._parameters.items()}
    state["_buffers"] = {name: None if b is None else buffers(b)
                         for name, b in module._buffers.items()}
    state["_modules"] = {name: None if m is None else copy_module(m, params, buffers, memo)
                         for name, m in module._modules.items()}
    init_flat = getattr(new, "_init_flat_weights", None)
    if callable(init_flat):  # RNNs keep a second list of their weights; point it at the copy
        init_flat()
    return new


def clone_buffer(buffer: torch.Tensor) -> torch.Tensor:
    """A part's private buffer: same values, its own storage, no history."""
    return buffer.detach().clone()


__all__ = ["clone_buffer", "copy_module"]
