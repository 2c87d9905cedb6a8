"""TorchOpt's ``torchopt.diff.implicit.custom_root``: implicit differentiation of a root
solver.

``custom_root(optimality_fn, argnums)(solver_fn)`` returns ``solver_fn`` whose result
``x* = solver_fn(init, *args)`` differentiates as the root of ``optimality_fn(x*, *args) = 0``
with respect to the arguments at ``argnums`` (never the first, the initial guess), whatever
``solver_fn`` did to get there. The backward pass is metadist's
:func:`metadist.meta.hypergrad.root_vjp` with the given linear solver (TorchOpt's default,
:func:`~metadist.compat.torchopt.linear_solve.solve_normal_cg`, runs metadist's conjugate
gradient). As in TorchOpt: ``solver_fn`` runs with gradients disabled (enable them inside for
an inner loop), the arguments at ``argnums`` must be tensors or tuples/lists of tensors, the
result must be a tensor or a tuple of tensors (with ``has_aux``: ``(result, aux)``), and the
backward pass evaluates ``optimality_fn`` on detached copies of every tensor argument,
positional arguments matched to ``optimality_fn``'s signature.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from metadist.compat.torchopt import _tree, linear_solve
from metadist.meta.hypergrad import root_vjp

__all__ = ["custom_root"]

Solver = Callable[..., Any]


def _bind_tagged(signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[bool, Any]]]:
    """``args``/``kwargs`` bound to ``signature``: the positional values, the keyword values
    and, for each positional value, where it came from (``(False, index)`` in ``args`` or
    ``(True, name)`` in ``kwargs``)."""
    tagged = signature.bind(*[(False, i, v) for i, v in enumerate(args)],
                            **{k: (True, k, v) for k, v in kwargs.items()})
    origin = [(was_kw, ref) for was_kw, ref, _ in tagged.args]
    return (tuple(v for _, _, v in tagged.args),
            {k: v for k, (_, _, v) in tagged.kwargs.items()}, origin)


def _detached(tree: Any) -> Any:
    return _tree.tree_map(lambda x: x.data if isinstance(x, torch.Tensor) else x, tree)


def _make_root(solver_fn: Solver, optimality_fn: Callable[..., Any], solve: Solver,
               argnums: tuple[int, ...], has_aux: bool,
               reference_signature: inspect.Signature | Callable[..., Any] | None = None
               ) -> Solver:
    solver_signature = inspect.signature(solver_fn)
    if reference_signature is None:
        reference_signature = inspect.signature(optimality_fn)
    elif not isinstance(reference_signature, inspect.Signature):
        reference_signature = inspect.signature(
            getattr(reference_signature, "subfn", reference_signature))
    reference: inspect.Signature = reference_signature

    @functools.wraps(solver_fn)
    def wrapped(*call_args: Any, **call_kwargs: Any) -> Any:
        bound = solver_signature.bind(*call_args, **call_kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args, bound.kwargs
        # the differentiable inputs, flattened: (position, count or None for a bare tensor)
        layout: list[tuple[int, int | None, type | None]] = []
        diff_inputs: list[torch.Tensor] = []
        for i, arg in enumerate(args):
            if i not in argnums:
                continue
            if isinstance(arg, torch.Tensor):
                layout.append((i, None, None))
                diff_inputs.append(arg)
            elif isinstance(arg, (tuple, list)) and all(map(torch.is_tensor, arg)):
                layout.append((i, len(arg), type(arg)))
                diff_inputs.extend(arg)
            else:
                raise RuntimeError(
                    "custom_root(optimality_fn)(solver_fn)(*args): argument of function "
                    "solver_fn specified with `argnums` should be a torch.Tensor or a tuple of "
                    "torch.Tensor")
        kept: dict[str, Any] = {}
        outputs = _Root.apply(_Spec(solver_fn, optimality_fn, solve, argnums, has_aux,
                                    reference, args, kwargs, layout, kept), *diff_inputs)
        result = outputs[0] if kept["is_tensor"] else kept["type"](outputs)
        return (result, kept["aux"]) if has_aux else result

    return wrapped


class _Spec:
    """What one call of a wrapped solver hands its autograd function."""

    def __init__(self, solver_fn: Solver, optimality_fn: Callable[..., Any], solve: Solver,
                 argnums: tuple[int, ...], has_aux: bool, reference: inspect.Signature,
                 args: tuple[Any, ...], kwargs: dict[str, Any],
                 layout: list[tuple[int, int | None, type | None]], kept: dict[str, Any]
                 ) -> None:
        self.solver_fn, self.optimality_fn, self.solve = solver_fn, optimality_fn, solve
        self.argnums, self.has_aux, self.reference = argnums, has_aux, reference
        self.args, self.kwargs, self.layout, self.kept = args, kwargs, layout, kept


class _Root(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _Spec, *diff_inputs: torch.Tensor) -> Any:
        output = spec.solver_fn(*spec.args, **spec.kwargs)
        aux = None
        if spec.has_aux:
            if not (isinstance(output, tuple) and len(output) == 2):
                raise RuntimeError(
                    "custom_root(optimality_fn)(solver_fn)(*args): output of function "
                    "solver_fn should be a tuple: (output, aux) if has_aux is True. "
                    f"Got {output}")
            output, aux = output
        is_tensor = isinstance(output, torch.Tensor)
        if is_tensor:
            output = (output,)
        elif not (isinstance(output, tuple) and all(map(torch.is_tensor, output))):
            raise RuntimeError(
                "custom_root(optimality_fn)(solver_fn)(*args): output of function solver_fn "
                f"should be a torch.Tensor or a tuple of torch.Tensor. Got {output}")
        solution = tuple(t.data for t in output)
        spec.kept.update(aux=aux, is_tensor=is_tensor, type=type(output))
        ctx.spec = spec
        ctx.detached = _detached((spec.args, spec.kwargs))
        spec.args, spec.kwargs = (), {}  # the backward pass reads the detached copies only
        ctx.save_for_backward(*solution)
        return solution

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        spec: _Spec = ctx.spec
        solution: tuple[torch.Tensor, ...] = ctx.saved_tensors
        args, kwargs = ctx.detached
        ref_args, ref_kwargs, origin = _bind_tagged(spec.reference, args, kwargs)
        if ref_kwargs:
            raise TypeError(
                "keyword arguments to solver_fn could not be resolved to positional arguments "
                f"based on the signature {spec.reference}. This can happen under custom_root "
                "if optimality_fn takes catch-all **kwargs, which is unsupported.")
        rest = list(ref_args[1:])
        wrt = [j for j in range(1, len(ref_args)) if j in spec.argnums]

        def residual(x: Any, *inputs: Any) -> Any:
            full = list(rest)
            for j, value in zip(wrt, inputs, strict=True):
                full[j - 1] = value
            return spec.optimality_fn(x, *full)

        x: Any = solution[0] if spec.kept["is_tensor"] else solution
        cotangent: Any = grad_outputs[0] if spec.kept["is_tensor"] else tuple(grad_outputs)
        grads = root_vjp(residual, x, [rest[j - 1] for j in wrt], cotangent, spec.solve)
        # back to the solver's positional arguments, then to the flattened inputs
        by_position = {origin[j][1]: g for j, g in zip(wrt, grads, strict=True)
                       if not origin[j][0]}
        flat: list[torch.Tensor | None] = []
        for position, count, _ in spec.layout:
            g = by_position.get(position)
            if count is None:
                flat.append(g)
            else:
                flat.extend(g if g is not None else [None] * count)
        return (None, *flat)


def custom_root(optimality_fn: Callable[..., Any], argnums: int | tuple[int, ...],
                has_aux: bool = False, solve: Solver | None = None
                ) -> Callable[[Solver], Solver]:
    """A decorator that makes a root solver differentiable by the implicit function theorem
    (module docstring). ``argnums`` index ``solver_fn``'s arguments, the first (the initial
    guess, 0) excluded; ``solve(matvec, b)`` defaults to
    :func:`~metadist.compat.torchopt.linear_solve.solve_normal_cg`."""
    if isinstance(argnums, int):
        assert argnums != 0
        argnums = (argnums,)
    else:
        assert 0 not in argnums
    if solve is None:
        solve = linear_solve.solve_normal_cg()
    return functools.partial(_make_root, optimality_fn=optimality_fn, solve=solve,
                             argnums=argnums, has_aux=has_aux)
