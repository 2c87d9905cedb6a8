"""FairScale's wrapping utilities: ``enable_wrap``, ``wrap``, ``auto_wrap`` and their policies.

They only decide which submodules get the wrapper class of the context (for
:class:`~metadist.compat.fairscale.nn.FullyShardedDataParallel`, each wrapped submodule
becomes one of zero3's units: gathered for its forward and backward, freed after).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

Policy = Callable[..., bool]


def default_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                             module_is_root: bool, min_num_params: int = int(1e8),
                             force_leaf_modules: set[type[nn.Module]] | None = None,
                             exclude_wrap_modules: set[type[nn.Module]] | None = None,
                             skip_params_check_for_root: bool = False) -> bool:
    """Wrap a module whose not-yet-wrapped parameters reach ``min_num_params``; never look
    inside ``force_leaf_modules``; never wrap ``exclude_wrap_modules`` (containers that
    have no forward of their own)."""
    leaves = FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    excluded = EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
    large = unwrapped_params >= min_num_params
    if recurse:
        return large and not isinstance(module, tuple(leaves))
    return (large or (module_is_root and skip_params_check_for_root)) and not isinstance(
        module, tuple(excluded))


#: types :func:`default_auto_wrap_policy` never wraps, and never looks inside
EXCLUDE_WRAP_MODULES: set[type[nn.Module]] = {nn.ModuleList, nn.ModuleDict}
FORCE_LEAF_MODULES: set[type[nn.Module]] = {nn.MultiheadAttention}
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
default_auto_wrap_policy.FORCE_LEAF_MODULES = FORCE_LEAF_MODULES  # type: ignore[attr-defined]


def config_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                            module_is_root: bool) -> bool:
    """Wrap the modules that carry a ``wrapper_config`` attribute; look everywhere."""
    return True if recurse else hasattr(module, "wrapper_config")


@dataclass
class _Context:
    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    policy: Policy | None = None
    move_module_cuda_half: bool = False


_context: _Context | None = None  # the enable_wrap block running


@contextmanager
def enable_wrap(auto_wrap_policy: Policy | None = None, **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the block, :func:`wrap` and :func:`auto_wrap` wrap modules in
    ``wrapper_cls`` with the other keyword arguments."""
    global _context
    if _context is not None:
        raise NotImplementedError("enable_wrap blocks do not nest: close the outer one first")
    if "wrapper_cls" not in wrapper_kwargs:
        raise ValueError("enable_wrap(wrapper_cls=..., **options) needs the wrapper class, e.g. "
                         "enable_wrap(wrapper_cls=FullyShardedDataParallel)")
    kwargs = dict(wrapper_kwargs)
    wrapper_cls = kwargs.pop("wrapper_cls")
    half = bool(kwargs.pop("move_module_cuda_half", False))
    _context = _Context(wrapper_cls, kwargs, auto_wrap_policy or default_auto_wrap_policy, half)
    try:
        yield
    finally:
        _context = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``module`` in the block's wrapper class (options: the block's, then the module's own
    ``wrapper_config``, then these); outside a block, ``module`` itself."""
    if _context is None:
        return module
    own = getattr(module, "wrapper_config", {})
    if not isinstance(own, dict):
        raise TypeError(f"{type(module).__name__}.wrapper_config must be a dict of wrapper "
                        f"options, got {type(own).__name__}")
    if _context.move_module_cuda_half:
        module = module.cuda().half()
    assert _context.wrapper_cls is not None
    return _context.wrapper_cls(module, **{**_context.kwargs, **own, **wrap_overrides})


def auto_wrap(module: nn.Module, auto_wrap_policy: Policy | None = None,
              **kwargs: Any) -> nn.Module:
    """Wrap the submodules of ``module`` (and ``module``) the policy chooses, innermost
    first; outside an :func:`enable_wrap` block, ``module`` itself."""
    if _context is None:
        return module
    return _recursive_wrap(module, auto_wrap_policy or _context.policy, True, **kwargs)[0]


def _recursive_wrap(module: nn.Module, policy: Policy | None, is_root: bool,
                    **kwargs: Any) -> tuple[nn.Module, int]:
    assert _context is not None and policy is not None
    wrapper = _context.wrapper_cls
    if isinstance(wrapper, type) and any(isinstance(m, wrapper) for m in module.modules()):
        raise ValueError(f"auto_wrap: {type(module).__name__} already holds a "
                         f"{wrapper.__name__}; auto_wrap a module once (or mark the modules to "
                         "wrap with wrapper_config and use config_auto_wrap_policy)")
    total = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, unwrapped_params=total, module_is_root=is_root):
        return module, 0
    wrapped = 0
    for name, child in module.named_children():
        new, count = _recursive_wrap(child, policy, False, **kwargs)
        setattr(module, name, new)
        wrapped += count
    if policy(module=module, recurse=False, unwrapped_params=total - wrapped,
              module_is_root=is_root):
        return wrap(module, **kwargs), total
    return module, wrapped


__all__ = ["auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap",
           "wrap"]
