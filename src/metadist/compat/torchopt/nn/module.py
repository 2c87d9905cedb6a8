"""TorchOpt's ``torchopt.nn.MetaGradientModule``: an ``nn.Module`` that tells its own
parameters from its meta-parameters.

What the constructor was given decides: every tensor argument that requires grad, and every
parameter of every module argument in training mode, is a meta-parameter (those modules and
their submodules are meta-modules). Assigning one of those to an attribute registers it in
``_meta_parameters`` / ``_meta_modules``; anything else that requires grad is an ordinary
parameter (a non-leaf tensor too), other modules are ordinary children. ``parameters()`` then
yields the module's own (inner) parameters and ``meta_parameters()`` the others, so an inner
loop optimises the former and the outer one the latter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from metadist.compat.torchopt import _tree

__all__ = ["MetaGradientModule", "MetaInputsContainer"]


class MetaInputsContainer(NamedTuple):
    """The constructor's meta-parameters and meta-modules."""

    meta_parameters: set[torch.Tensor]
    meta_modules: set[nn.Module]


def _forget(module: nn.Module, name: str, *places: str) -> None:
    """``name`` out of the instance dict and each named dict or set of ``module``."""
    module.__dict__.pop(name, None)
    for place in places:
        where = getattr(module, place)
        if isinstance(where, set):
            where.discard(name)
        else:
            where.pop(name, None)


def _check_name(module: nn.Module, name: Any, kind: str, own: dict[str, Any]) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{kind} name should be a string. Got {torch.typename(name)}")
    if "." in name:
        raise KeyError(f"{kind} name can't contain '.'")
    if name == "":
        raise KeyError(f"{kind} name can't be empty string ''")
    if hasattr(module, name) and name not in own:
        raise KeyError(f"attribute '{name}' already exists")


def _check_tensor(name: str, param: Any, kind: str) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"cannot assign '{torch.typename(param)}' object to {kind} '{name}' "
                        "(torch.Tensor or None required)")
    if not param.requires_grad:
        raise ValueError(f"cannot assign Tensor that `requires_grad=False` to {kind} '{name}'")


def _check_module_name(module: nn.Module, name: Any, kind: str, own: dict[str, Any],
                       value: Any) -> None:
    if not isinstance(value, nn.Module) and value is not None:
        raise TypeError(f"{torch.typename(value)} is not a Module subclass")
    if not isinstance(name, str):
        raise TypeError(f"{kind} name should be a string. Got {torch.typename(name)}")
    if hasattr(module, name) and name not in own:
        raise KeyError(f"attribute '{name}' already exists")
    if "." in name:
        raise KeyError(f"{kind} name can't contain '.', got: '{name}'")
    if name == "":
        raise KeyError(f"{kind} name can't be empty string ''")


class MetaGradientModule(nn.Module):
    """An ``nn.Module`` with meta-parameters and meta-modules (module docstring)."""

    _meta_inputs: MetaInputsContainer
    _meta_parameters: dict[str, torch.Tensor | None]
    _meta_modules: dict[str, nn.Module | None]

    def __new__(cls, *args: Any, **kwargs: Any) -> MetaGradientModule:
        self = super().__new__(cls)
        given = _tree.leaves((args, kwargs))
        params = {x for x in given if isinstance(x, torch.Tensor) and x.requires_grad}
        modules = {x for x in given if isinstance(x, nn.Module) and x.training}
        for m in tuple(modules):
            params.update(m.parameters())
            modules.update(m.modules())
        object.__setattr__(self, "_meta_inputs", MetaInputsContainer(params, modules))
        object.__setattr__(self, "_meta_parameters", OrderedDict())
        object.__setattr__(self, "_meta_modules", OrderedDict())
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for place in ("_parameters", "_buffers", "_modules", "_meta_parameters",
                      "_meta_modules"):
            if place in d and name in d[place]:
                return d[place][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        params, meta_params = d.get("_parameters"), d.get("_meta_parameters")
        modules, meta_modules = d.get("_modules"), d.get("_meta_modules")
        if isinstance(value, torch.Tensor) and value.requires_grad:
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            if meta_params is None:
                raise AttributeError("cannot assign meta-parameters before "
                                     "MetaGradientModule.__init__() call")
            _forget(self, name, "_buffers", "_modules", "_non_persistent_buffers_set",
                    "_meta_parameters", "_meta_modules")
            if value in self._meta_inputs.meta_parameters:
                self.register_meta_parameter(name, value)
            else:
                self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(f"cannot assign '{torch.typename(value)}' as parameter "
                                f"'{name}' (torch.Tensor or None expected)")
            self.register_parameter(name, value)
        elif meta_params is not None and name in meta_params:
            if value is not None:
                raise TypeError(f"cannot assign '{torch.typename(value)}' as meta-parameter "
                                f"'{name}' (torch.Tensor or None expected)")
            self.register_meta_parameter(name, value)
        elif isinstance(value, nn.Module):
            if modules is None or meta_modules is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            _forget(self, name, "_parameters", "_buffers", "_non_persistent_buffers_set",
                    "_meta_parameters", "_meta_modules")
            if value in self._meta_inputs.meta_modules:
                meta_modules[name] = value
            else:
                modules[name] = value
        elif modules is not None and name in modules:
            if value is not None:
                raise TypeError(f"cannot assign '{torch.typename(value)}' as child module "
                                f"'{name}' (torch.nn.Module or None expected)")
            modules[name] = value
        elif (buffers := d.get("_buffers")) is not None and name in buffers:
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"cannot assign '{torch.typename(value)}' as buffer '{name}' "
                                "(torch.Tensor or None expected)")
            buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for place in ("_parameters", "_buffers", "_modules", "_meta_parameters",
                      "_meta_modules"):
            where = getattr(self, place)
            if name in where:
                del where[name]
                if place == "_buffers":
                    self._non_persistent_buffers_set.discard(name)
                return
        object.__delattr__(self, name)

    # ----- registration ------------------------------------------------------------------
    def register_parameter(self, name: str, param: torch.Tensor | None) -> None:
        """An inner parameter (any tensor that requires grad; not a meta-parameter)."""
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameter before Module.__init__() call")
        _check_name(self, name, "parameter", self._parameters)
        if param is not None:
            _check_tensor(name, param, "parameter")
            if param in self._meta_inputs.meta_parameters:
                raise ValueError(f"cannot assign Tensor that is a meta-parameter to parameter "
                                 f"'{name}'. Use self.register_meta_parameter() instead.")
        self._parameters[name] = param  # type: ignore[assignment]

    def register_meta_parameter(self, name: str, param: torch.Tensor | None) -> None:
        """A meta-parameter (a tensor that requires grad)."""
        if "_meta_parameters" not in self.__dict__:
            raise AttributeError("cannot assign meta-parameter before "
                                 "MetaGradientModule.__init__() call")
        _check_name(self, name, "meta-parameter", self._meta_parameters)
        if param is not None:
            _check_tensor(name, param, "meta-parameter")
        self._meta_parameters[name] = param

    def add_module(self, name: str, module: nn.Module | None) -> None:
        """An ordinary child module (not one of the constructor's meta-modules)."""
        _check_module_name(self, name, "module", self._modules, module)
        if module in self._meta_inputs.meta_modules:
            raise ValueError(f"cannot add module that is a meta-module to module '{name}'. "
                             "Use self.add_meta_module() instead.")
        self._modules[name] = module

    def register_module(self, name: str, module: nn.Module | None) -> None:
        """:meth:`add_module`."""
        self.add_module(name, module)

    def add_meta_module(self, name: str, meta_module: nn.Module | None) -> None:
        """A child meta-module: its parameters are meta-parameters."""
        _check_module_name(self, name, "meta-module", self._meta_modules, meta_module)
        self._meta_modules[name] = meta_module

    def register_meta_module(self, name: str, meta_module: nn.Module | None) -> None:
        """:meth:`add_meta_module`."""
        self.add_meta_module(name, meta_module)

    # ----- iteration ---------------------------------------------------------------------
    def meta_parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """The meta-parameters: this module's own, then those of its meta-modules."""
        for _, p in self.named_meta_parameters(recurse=recurse):
            yield p

    def named_meta_parameters(self, prefix: str = "", recurse: bool = True
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, meta-parameter)``, each own meta-parameter once, then each meta-module's
        ``named_parameters``."""
        seen: set[torch.Tensor] = set()
        for name, p in getattr(self, "_meta_parameters", {}).items():
            if p is not None and p not in seen:
                seen.add(p)
                yield prefix + name, p
        for name, m in getattr(self, "_meta_modules", {}).items():
            if m is not None:
                yield from m.named_parameters(prefix + name, recurse)

    def meta_children(self) -> Iterator[nn.Module]:
        """The immediate meta-modules."""
        for _, m in self.named_meta_children():
            yield m

    def named_meta_children(self) -> Iterator[tuple[str, nn.Module]]:
        """``(name, meta-module)`` for the immediate meta-modules, each once."""
        seen: set[nn.Module] = set()
        for name, m in self._meta_modules.items():
            if m is not None and m not in seen:
                seen.add(m)
                yield name, m

    def meta_modules(self) -> Iterator[nn.Module]:
        """Every meta-module and its submodules, each once."""
        for _, m in self.named_meta_modules():
            yield m

    def named_meta_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                           remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """``(qualified name, module)`` over the meta-modules' ``named_modules``."""
        memo = set() if memo is None else memo
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        for name, m in self._meta_modules.items():
            if m is not None:
                yield from m.named_modules(memo, prefix + ("." if prefix else "") + name,
                                           remove_duplicate)
