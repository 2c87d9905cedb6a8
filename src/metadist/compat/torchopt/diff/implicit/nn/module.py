"""TorchOpt's ``ImplicitMetaGradientModule``: a module whose ``solve(*input)`` finds its
parameters (the inner problem's solution) from its meta-parameters, and whose parameters then
differentiate with respect to the meta-parameters implicitly, through ``optimality(*input)``
(or the gradient of ``objective(*input)`` with respect to the parameters, if only that is
defined), by :func:`~metadist.compat.torchopt.diff.implicit.custom_root`.

``class M(ImplicitMetaGradientModule, linear_solve=solver)`` picks the linear solver
(TorchOpt's default, conjugate gradient on the normal equations, otherwise).
"""

from __future__ import annotations

import abc
import functools
import inspect
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from metadist.compat.torchopt.diff.implicit.decorator import custom_root
from metadist.compat.torchopt.nn.module import MetaGradientModule
from metadist.compat.torchopt.nn.stateless import reparametrize, swap_state

__all__ = ["ImplicitMetaGradientModule"]

Tensors = tuple[torch.Tensor, ...]


def _named(self: MetaGradientModule) -> tuple[tuple[str, ...], Tensors, tuple[str, ...],
                                               Tensors]:
    params = tuple(self.named_parameters())
    meta = tuple(self.named_meta_parameters())
    if not params:
        raise RuntimeError("The module has no parameters.")
    if not meta:
        raise RuntimeError("The module has no meta-parameters.")
    names, flat = zip(*params, strict=True)
    meta_names, meta_flat = zip(*meta, strict=True)
    return names, flat, meta_names, meta_flat


def _on(self: MetaGradientModule, names: Iterable[str], flat: Tensors,
        meta_names: Iterable[str], meta_flat: Tensors) -> Any:
    return reparametrize(self, itertools.chain(zip(names, flat, strict=True),
                                               zip(meta_names, meta_flat, strict=True)))


def _stateless_objective_fn(flat_params: Tensors, flat_meta_params: Tensors,
                            params_names: Iterable[str], meta_params_names: Iterable[str],
                            self: ImplicitMetaGradientModule, /, *input: Any,
                            **kwargs: Any) -> torch.Tensor:
    with _on(self, params_names, flat_params, meta_params_names, flat_meta_params):
        return self.objective(*input, **kwargs)


def _stateless_optimality_fn(flat_params: Tensors, flat_meta_params: Tensors,
                             params_names: Iterable[str], meta_params_names: Iterable[str],
                             self: ImplicitMetaGradientModule, /, *input: Any,
                             **kwargs: Any) -> Tensors:
    with _on(self, params_names, flat_params, meta_params_names, flat_meta_params):
        return self.optimality(*input, **kwargs)


def make_optimality_from_objective(cls: type[ImplicitMetaGradientModule]
                                   ) -> type[ImplicitMetaGradientModule]:
    """Give ``cls`` an ``optimality`` that is the gradient of its ``objective`` with respect
    to its parameters."""
    base = inspect.getattr_static(ImplicitMetaGradientModule, "objective")
    if inspect.getattr_static(cls, "objective", base) is base:
        raise TypeError("The objective function is not defined.")

    def optimality(self: ImplicitMetaGradientModule, *input: Any, **kwargs: Any) -> Tensors:
        names, flat, meta_names, meta_flat = _named(self)
        grad = torch.func.grad(_stateless_objective_fn, argnums=0)
        return grad(flat, meta_flat, names, meta_names, self, *input,  # type: ignore[no-any-return]
                    **kwargs)

    cls.optimality = optimality  # type: ignore[method-assign]
    return cls


def enable_implicit_gradients(cls: type[ImplicitMetaGradientModule]
                              ) -> type[ImplicitMetaGradientModule]:
    """Make ``cls.solve`` leave parameters that differentiate implicitly."""
    cls_solve = cls.solve
    if getattr(cls_solve, "__implicit_gradients_enabled__", False):
        raise TypeError("Implicit gradients are already enabled for the `solve` method.")
    solver = {"solve": cls.linear_solve} if cls.linear_solve is not None else {}

    @custom_root(_stateless_optimality_fn, argnums=1, has_aux=True, **solver)
    def stateless_solver_fn(flat_params: Tensors, flat_meta_params: Tensors,
                            params_names: Iterable[str], meta_params_names: Iterable[str],
                            self: ImplicitMetaGradientModule, /, *input: Any,
                            **kwargs: Any) -> tuple[Tensors, Any]:
        output = cls_solve(self, *input, **kwargs)
        return tuple(p.detach_() for p in self.parameters()), output

    @functools.wraps(cls_solve)
    def wrapped(self: ImplicitMetaGradientModule, *input: Any, **kwargs: Any) -> Any:
        names, flat, meta_names, meta_flat = _named(self)
        optimal, output = stateless_solver_fn(flat, meta_flat, names, meta_names, self,
                                              *input, **kwargs)
        swap_state(self, zip(names, optimal, strict=True))
        return output

    wrapped.__implicit_gradients_enabled__ = True  # type: ignore[attr-defined]
    cls.solve = wrapped  # type: ignore[method-assign]
    return cls


def _check_method(cls: type, name: str) -> None:
    method = inspect.getattr_static(cls, name)
    if isinstance(method, staticmethod):
        raise TypeError(f"method {name}() must not be a staticmethod.")
    if isinstance(method, classmethod):
        raise TypeError(f"method {name}() must not be a classmethod.")
    if not callable(method):
        raise TypeError(f"method {name}() must be callable.")


class ImplicitMetaGradientModule(MetaGradientModule, metaclass=abc.ABCMeta):
    """The base class of modules whose parameters solve an inner problem (module
    docstring)."""

    _custom_optimality: bool
    _custom_objective: bool
    linear_solve: Callable[..., Any] | None

    def __init_subclass__(cls, linear_solve: Callable[..., Any] | None = None) -> None:
        super().__init_subclass__()
        cls.linear_solve = linear_solve
        base = ImplicitMetaGradientModule
        cls._custom_optimality = (inspect.getattr_static(cls, "optimality")
                                  is not inspect.getattr_static(base, "optimality"))
        cls._custom_objective = (inspect.getattr_static(cls, "objective")
                                 is not inspect.getattr_static(base, "objective"))
        if cls._custom_optimality:
            _check_method(cls, "optimality")
        elif not cls._custom_objective:
            raise TypeError("ImplicitMetaGradientModule requires either an optimality() "
                            "method or an objective() method")
        else:
            _check_method(cls, "objective")
            make_optimality_from_objective(cls)
        enable_implicit_gradients(cls)

    @abc.abstractmethod
    def solve(self, *input: Any, **kwargs: Any) -> Any:
        """Solve the inner problem: update the parameters (not the meta-parameters; pass
        ``inputs=`` to ``backward`` or use ``torch.autograd.grad``). Runs with gradients
        disabled, as in TorchOpt: enable them for a gradient-based inner loop."""
        raise NotImplementedError(f"{type(self).__name__} must define solve(), which fits "
                                  "its parameters to the inner problem")

    def optimality(self, *input: Any, **kwargs: Any) -> Tensors:
        """The residual that is zero at the solution, one tensor per parameter (e.g. the
        objective's gradient); derived from :meth:`objective` if not defined."""
        raise NotImplementedError(f"{type(self).__name__} defines neither optimality() nor "
                                  "objective(); define one of them")

    def objective(self, *input: Any, **kwargs: Any) -> torch.Tensor:
        """The inner objective (a scalar), for the derived :meth:`optimality`."""
        raise NotImplementedError(f"{type(self).__name__} defines optimality() but not "
                                  "objective(); define objective() to call it")
