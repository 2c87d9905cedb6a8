"""TorchOpt's module and state utilities: ``ModuleState``, ``extract_state_dict``,
``recover_state_dict``, ``module_clone``, ``stop_gradient``, ``module_detach_``.

TorchOpt's semantics, which differ from :mod:`metadist.meta.modules` in two places: a module's
snapshot is a :class:`ModuleState` of per-module containers (not a name -> tensor dict), and
``detach_buffers=True`` gives buffers *fresh storage* (metadist's own detaches them in place of
the original storage). The second matters: BatchNorm's running statistics, updated in place by
a clone's forward, must not change the original module's.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from metadist.meta.modules import unwrap

__all__ = ["ModuleState", "extract_state_dict", "module_clone", "module_detach_",
           "recover_state_dict", "stop_gradient"]

CopyMode = Literal["reference", "copy", "deepcopy", "ref", "clone", "deepclone"]
_MODES = ("reference", "copy", "deepcopy", "ref", "clone", "deepclone")


class ModuleState(NamedTuple):
    """A module's tensors by container: ``params`` and ``buffers`` are tuples with one dict per
    (sub)module that has any, in ``module.modules()`` order."""

    params: tuple[dict[str, Tensor], ...]
    buffers: tuple[dict[str, Tensor], ...]
    visual_contents: dict[Any, Any] | None = None
    detach_buffers: bool = False


def _mode(by: str) -> str:
    if by not in _MODES:
        raise ValueError(f"by={by!r} is not known; choose one of: {', '.join(_MODES)}")
    return {"ref": "reference", "clone": "copy", "deepclone": "deepcopy"}.get(by, by)


def _detached_copy(t: Tensor, device: torch.device | None) -> Tensor:
    moved = t.clone().to(device=device) if device is not None else t.clone()
    if isinstance(t, nn.Parameter):
        return nn.Parameter(moved.detach_(), requires_grad=t.requires_grad)
    return moved.detach_().requires_grad_(t.requires_grad)


def _replicator(by: str, device: str | torch.device | None) -> Callable[[Tensor], Tensor]:
    target = torch.device(device) if device is not None else None
    match _mode(by):
        case "reference":
            return (lambda t: t) if target is None else (lambda t: t.to(device=target))
        case "copy":
            return (lambda t: t.clone()) if target is None else (
                lambda t: t.clone().to(device=target))
    return lambda t: _detached_copy(t, target)


def _containers(module: nn.Module, with_buffers: bool
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The non-empty ``_parameters`` (and ``_buffers``) dicts of every submodule, once each."""
    params, buffers = [], []
    for sub in module.modules():  # modules() visits each submodule once
        if sub._parameters:
            params.append(sub._parameters)
        if with_buffers and sub._buffers:
            buffers.append(sub._buffers)
    return params, buffers


def extract_module_containers(module: nn.Module, with_buffers: bool = True
                              ) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]:
    """The ``_parameters`` (and ``_buffers``) dicts of ``module`` and its submodules that hold
    any, each once, in ``modules()`` order."""
    params, buffers = _containers(unwrap(module), with_buffers)
    return tuple(params), tuple(buffers)


def extract_state_dict(target: Any, *, by: CopyMode = "reference",
                       device: str | torch.device | None = None, with_buffers: bool = True,
                       detach_buffers: bool = False, enable_visual: bool = False,
                       visual_prefix: str = "") -> Any:
    """A module's :class:`ModuleState`, or a meta-optimiser's state (a tuple of states), with
    tensors taken ``by`` reference, ``copy`` (in the graph) or ``deepcopy`` (detached), moved
    to ``device`` if given. ``enable_visual`` records ``grad_fn``/tensor -> name annotations
    (prefixed by ``visual_prefix``) for graph visualisation."""
    from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

    replicate = _replicator(by, device)
    if isinstance(target, MetaOptimizer):
        return tree_map(lambda t: replicate(t) if isinstance(t, Tensor) else t,
                        target.state_dict())
    if not isinstance(target, nn.Module):
        raise TypeError(f"extract_state_dict takes an nn.Module or a MetaOptimizer, got "
                        f"{type(target).__name__}")
    module = unwrap(target)
    visual: dict[Any, Any] | None = None
    if enable_visual:
        visual = {}
        for name, p in module.named_parameters():
            key = p.grad_fn if p.grad_fn is not None else p
            visual[key] = (visual_prefix + name, p) if p.grad_fn is not None else \
                visual_prefix + name
    params, buffers = _containers(module, with_buffers)
    take_buffer = (lambda t: _detached_copy(t, torch.device(device) if device else None)) \
        if detach_buffers else replicate
    return ModuleState(
        params=tuple({k: replicate(v) for k, v in c.items() if isinstance(v, Tensor)}
                     for c in params),
        buffers=tuple({k: take_buffer(v) for k, v in c.items() if isinstance(v, Tensor)}
                      for c in buffers),
        visual_contents=visual, detach_buffers=detach_buffers)


def recover_state_dict(target: Any, state: Any) -> None:
    """Put a state from :func:`extract_state_dict` back (tensors rebound, not copied; with
    ``detach_buffers`` the buffers get fresh detached copies)."""
    from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

    if isinstance(target, MetaOptimizer):
        target.load_state_dict(state)
        return
    if not isinstance(target, nn.Module) or not isinstance(state, ModuleState):
        raise TypeError("recover_state_dict(module, state) needs the ModuleState that "
                        "extract_state_dict(module) returned (or a MetaOptimizer and its state)")
    params, buffers = _containers(unwrap(target), with_buffers=True)
    restored = state.buffers
    if state.detach_buffers:
        restored = tuple({k: _detached_copy(v, None) for k, v in c.items()} for c in restored)
    if len(params) != len(state.params) or len(buffers) < len(restored):
        raise ValueError(f"this state has {len(state.params)} parameter containers, the module "
                         f"{len(params)}: recover into a module of the structure it came from")
    for tgt, src in itertools.chain(zip(params, state.params, strict=True),
                                    zip(buffers, restored, strict=False)):
        tgt.update(src)


def module_clone(target: Any, *, by: CopyMode = "reference", detach_buffers: bool = False,
                 device: str | torch.device | None = None) -> Any:
    """A clone of a module or a meta-optimiser (its tensors taken ``by`` and moved to
    ``device``), or of a tree of tensors."""
    from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

    if isinstance(target, nn.Module | MetaOptimizer):
        source = unwrap(target) if isinstance(target, nn.Module) else target
        # A meta-optimiser's clone shares its parameter containers' tensors (rebound by its
        # steps, so possibly non-leaves, which deepcopy refuses) and gets the state ``by``.
        shared = (_containers(source, True) if isinstance(source, nn.Module)
                  else (source.state_dict(), source.param_containers_groups))
        # The tensors are replaced right after; deepcopy must not copy them first.
        memo = {id(t): t for t in tree_leaves(shared) if isinstance(t, Tensor)}
        cloned = copy.deepcopy(source, memo)
        recover_state_dict(cloned, extract_state_dict(source, by=by, device=device,
                                                      detach_buffers=detach_buffers))
        return cloned
    replicate = _replicator(by, device)
    return tree_map(lambda t: replicate(t) if isinstance(t, Tensor) else t, target)


def stop_gradient(target: Any) -> None:
    """Detach, in place, the tensors of a ModuleState, a module's parameters, a
    meta-optimiser's state or a tree of tensors (``requires_grad`` kept)."""
    from metadist.compat.torchopt.optim.meta.base import MetaOptimizer

    if isinstance(target, ModuleState):
        tensors: Sequence[Any] = tree_leaves((target.params, target.buffers))
    elif isinstance(target, nn.Module):
        tensors = list(target.parameters())
    elif isinstance(target, MetaOptimizer):
        tensors = tree_leaves(target.state_dict())
    else:
        tensors = tree_leaves(target)
    for t in tensors:
        if isinstance(t, Tensor):
            requires_grad = t.requires_grad
            t.detach_().requires_grad_(requires_grad)


def module_detach_(target: Any) -> Any:
    """:func:`stop_gradient` that returns its argument."""
    stop_gradient(target)
    return target
