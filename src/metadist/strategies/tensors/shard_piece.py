"""A piece of fast weights that is a shard: operations across its elements stop.

Under zero3/hsdp a piece of ``model.fast_weights()`` is this rank's flat slice of several
parameters, under ddp a whole parameter. Element-wise arithmetic means the same on both;
anything that combines elements (a sum, a norm, a max, indexing, a reshape, concatenating
pieces) computes one thing under ddp and another under zero3, silently. A library that takes
fast weights as a pytree (an optimiser's transformation clipping by the norm of its leaves)
would do exactly that. So every sharded piece, and every tensor computed from one, is a
:class:`ShardPiece`, whose operators of that kind raise; metadist's own code that combines
pieces correctly (over every shard: ``fast.dot``, ``fast.norm``) runs inside
:func:`shard_internals`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_INTERNAL: ContextVar[bool] = ContextVar("metadist_shard_internals", default=False)

# Operators that combine elements of a piece, or pieces, by name.
ACROSS = frozenset({
    "sum", "nansum", "mean", "nanmean", "norm", "vector_norm", "matrix_norm", "dist", "max",
    "min", "amax", "amin", "aminmax", "argmax", "argmin", "prod", "std", "var", "std_mean",
    "var_mean", "median", "nanmedian", "mode", "logsumexp", "cumsum", "cumprod", "cummax",
    "cummin", "logcumsumexp", "sort", "argsort", "msort", "topk", "kthvalue", "flip", "fliplr",
    "flipud", "roll", "rot90", "dot", "vdot", "inner", "outer", "matmul", "mm", "mv", "bmm",
    "einsum", "tensordot", "cat", "concat", "concatenate", "stack", "hstack", "vstack",
    "dstack", "view", "reshape", "view_as", "reshape_as", "flatten", "unflatten",
    "__getitem__", "__setitem__", "split", "chunk", "unbind", "narrow", "select",
    "index_select", "gather", "scatter", "scatter_add", "take", "take_along_dim",
    "masked_select", "nonzero", "unique", "unique_consecutive", "count_nonzero", "all", "any",
    "softmax", "log_softmax", "tolist", "numpy", "item", "histc", "bincount", "diff", "trace",
    "diag", "t", "transpose", "permute", "expand", "repeat", "tile", "clip_grad_norm_",
    "_foreach_norm", "allclose", "equal"})
# Run as on plain tensors: printing a piece, and autograd's entry points (the gradients it
# returns are of whatever a piece went into, not pieces).
_PLAIN = frozenset({"__repr__", "__str__", "__format__", "grad", "backward"})


def function_name(func: Any) -> str:
    """The name of what ``__torch_function__`` was called for (a property by its own)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name)


def internal() -> bool:
    """Whether metadist's own operations across pieces are running (:func:`shard_internals`)."""
    return _INTERNAL.get()


# Operators beyond those torch tags pointwise that keep each element where it is: copies,
# fills, conversions, ``*_like`` buffers, and the optimizers' multi-tensor kernels.
_IN_PLACE_OF_ELEMENTS = frozenset({
    "zero_", "fill_", "masked_fill_", "masked_fill", "copy_", "detach", "alias", "_to_copy",
    "lift_fresh", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros",
    "new_ones", "new_empty", "new_full", "empty_strided", "clone", "_pin_memory"})
_ACROSS_KERNELS = ("_foreach_norm", "_foreach_max")
# What a tensor is, not what it holds (an optimizer reads these on every step).
_METADATA = frozenset({
    "is_complex", "is_sparse", "device", "is_leaf", "dtype", "shape", "size", "dim", "ndim",
    "numel", "nelement", "requires_grad", "is_floating_point", "is_contiguous", "stride",
    "storage_offset", "data_ptr", "untyped_storage", "layout", "is_cuda", "is_cpu",
    "is_meta", "grad_fn", "_version", "element_size", "is_nested", "is_quantized",
    "is_pinned", "is_shared", "get_device", "is_inference", "is_signed", "itemsize", "nbytes",
    "record_stream"})


def _element_wise(op: torch._ops.OpOverload) -> bool:
    if torch.Tag.pointwise in op.tags:
        return True
    name = op.overloadpacket.__name__
    if name.startswith(("_foreach_", "_fused_")):
        return not name.startswith(_ACROSS_KERNELS)
    return name in _IN_PLACE_OF_ELEMENTS


def masked_assignment(name: str, args: Any) -> bool:
    """``t[mask] = value`` with a boolean mask of ``t``'s shape and one value (Rprop's
    step-size update): element-wise, though ``__setitem__`` in general is not."""
    if name != "__setitem__" or len(args) != 3:
        return False
    target, index, value = args
    return (isinstance(index, Tensor) and index.dtype == torch.bool
            and index.shape == target.shape
            and (not isinstance(value, Tensor) or value.numel() == 1))


@functools.cache
def known_element_wise(name: str) -> bool:
    """Whether the torch function ``name`` is an operator element-wise in every overload
    (``add_``, ``lerp_``, ``addcdiv_``): such calls need no :class:`ElementWise` watch,
    which costs tens of microseconds a call (an optimizer's step makes many)."""
    if name in _METADATA:
        return True
    if name.startswith("__") and name.endswith("__"):  # __mul__, __rmul__, __imul__ -> mul
        bare = name[2:-2]
        bare = bare[1:] + "_" if bare.startswith("i") and known_element_wise(bare[1:]) else (
            bare[1:] if bare.startswith("r") and known_element_wise(bare[1:]) else bare)
        name = {"truediv": "div", "truediv_": "div_", "and": "bitwise_and",
                "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not"}.get(bare, bare)
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    overloads = [getattr(packet, o) for o in packet.overloads() if "out" not in o]
    on_tensors = [op for op in overloads  # not the overloads of Python numbers or lists
                  if op._schema.arguments and str(op._schema.arguments[0].type) == "Tensor"]
    return bool(on_tensors) and all(_element_wise(op) for op in on_tensors)


class ElementWise(TorchDispatchMode):
    """While a program's call on a shard runs: every operator it reaches keeps elements
    apart, or the call stops with ``refusal(operator)``. Deciding by the operators torch
    runs, not by the function called, covers any composite (``F.normalize``,
    ``torch.linalg.vector_norm``, a library's own helper) without naming it."""

    def __init__(self, refusal: Callable[[str], str]) -> None:
        super().__init__()
        self.refusal = refusal

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if not _element_wise(func):
            raise ValueError(self.refusal(str(func.overloadpacket.__name__)))
        return func(*args, **(kwargs or {}))


@contextmanager
def shard_internals() -> Iterator[None]:
    """Inside: metadist's own operations across pieces (which it makes global)."""
    token = _INTERNAL.set(True)
    try:
        yield
    finally:
        _INTERNAL.reset(token)


_FAST_ADVICE = (
    "on a piece of fast weights that are shards: under zero3/hsdp a piece is this rank's "
    "flat slice of several parameters (under ddp a whole parameter), so it would compute "
    "something else than one process. Use fast.dot(other) or fast.norm() for a sum over "
    "every parameter (one collective), fast.like({name: tensor}) for per-parameter values, "
    "or model.functional_forward(fast, ...) for anything that needs whole parameters")


class ShardPiece(Tensor):
    """A piece of shard fast weights, or a tensor computed from one (see the module
    notes): element-wise operators only."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = function_name(func)
        if name in _PLAIN:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if _INTERNAL.get():
            return super().__torch_function__(func, types, args, kwargs)
        if masked_assignment(name, args) or known_element_wise(name):
            return super().__torch_function__(func, types, args, kwargs)
        if name in ACROSS:
            raise ValueError(f"fast-weight arithmetic ran {name}, which is not element-wise, "
                             + _FAST_ADVICE)
        with ElementWise(lambda op: f"fast-weight arithmetic ran {name}, which runs {op}, "
                         "not element-wise, " + _FAST_ADVICE):
            return super().__torch_function__(func, types, args, kwargs)


def as_piece(t: Tensor) -> Tensor:
    """``t`` as a :class:`ShardPiece` (the same data, still in its autograd graph)."""
    return t if isinstance(t, ShardPiece) else t.as_subclass(ShardPiece)


def plain(t: Tensor) -> Tensor:
    """``t`` as a plain tensor (the same data, still in its autograd graph)."""
    return t.as_subclass(Tensor) if isinstance(t, ShardPiece) else t
