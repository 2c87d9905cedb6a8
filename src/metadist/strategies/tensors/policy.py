"""The one policy of metadist's rank-local tensors: which calls run on this rank's part as
they are, which are computed over the whole, which stop.

[Note: one tensor policy]
Every kind of rank-local tensor (a zero3/hsdp parameter's slice and what is computed from
it, shard_value.py; a sharded fast-weight piece, shard_piece.py; zero2's gradients, owned or
kept elsewhere, elsewhere.py; the parameter itself, strategies/zero3/sharded_param.py)
decides a call by the classes named here, so that the kinds cannot drift apart:

* element-wise: an operator torch tags pointwise, or one of :data:`IN_PLACE_OF_ELEMENTS`,
  or a multi-tensor kernel other than :data:`ACROSS_KERNELS`: what one process computes on
  those elements. :class:`ElementWise` decides by the operators torch runs, so a composite
  (``F.normalize``, a library's helper) is judged by what it does, not by its name;
* :data:`WHOLE` reductions over all of a tensor, and :data:`READS` of its values: computed
  over the whole where the tensor's span says where the rest is (whole_reductions.py);
* :data:`ACROSS`: calls that combine elements and run no operator to watch (``numpy``,
  ``tolist``), refused by name;
* :data:`METADATA` and :data:`DESCRIBES`: what a tensor is, answered as for any tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

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
#: printing, and autograd's entry points: what every kind runs as on a plain tensor
PLAIN = frozenset({"__repr__", "__str__", "__format__", "grad", "backward"})


def function_name(func: Any, setters: bool = False) -> str:
    """The name of what ``__torch_function__`` was called for: a property by its own name
    (``setters``: a property's setter as ``"name="``)."""
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", name)
        return f"{prop}=" if setters and name == "__set__" else str(prop)
    return str(name)


# Operators beyond those torch tags pointwise that keep each element where it is: copies,
# fills, conversions, ``*_like`` buffers, and the optimizers' multi-tensor kernels.
IN_PLACE_OF_ELEMENTS = frozenset({
    "zero_", "fill_", "masked_fill_", "masked_fill", "copy_", "detach", "alias", "_to_copy",
    "lift_fresh", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros",
    "new_ones", "new_empty", "new_full", "empty_strided", "clone", "_pin_memory"})
ACROSS_KERNELS = ("_foreach_norm", "_foreach_max")
# What a tensor is, not what it holds (an optimizer reads these on every step).
METADATA = frozenset({
    "is_complex", "is_sparse", "device", "is_leaf", "dtype", "shape", "size", "dim", "ndim",
    "numel", "nelement", "requires_grad", "is_floating_point", "is_contiguous", "stride",
    "storage_offset", "data_ptr", "untyped_storage", "layout", "is_cuda", "is_cpu",
    "is_meta", "grad_fn", "_version", "element_size", "is_nested", "is_quantized",
    "is_pinned", "is_shared", "get_device", "is_inference", "is_signed", "itemsize", "nbytes",
    "record_stream"})


def element_wise(op: torch._ops.OpOverload) -> bool:
    if torch.Tag.pointwise in op.tags:
        return True
    name = op.overloadpacket.__name__
    if name.startswith(("_foreach_", "_fused_")):
        return not name.startswith(ACROSS_KERNELS)
    return name in IN_PLACE_OF_ELEMENTS


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
    if name in METADATA:
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
    return bool(on_tensors) and all(element_wise(op) for op in on_tensors)


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
        if not element_wise(func):
            raise ValueError(self.refusal(str(func.overloadpacket.__name__)))
        return func(*args, **(kwargs or {}))


#: whole-tensor reductions computed over the whole, by torch function name
WHOLE = frozenset({"sum", "mean", "norm", "vector_norm", "linalg_vector_norm", "amax", "amin",
                   "max", "min", "count_nonzero", "all", "any"})

#: reads of a tensor's values answered, where one rank holds the whole, with its values
READS = frozenset({"item", "tolist", "numpy", "__array__", "__float__", "__int__", "__bool__",
                   "__index__", "__complex__", "__format__"})

#: reads of values (or of where they are) that a tensor with no values here refuses
VALUE_READS = READS - {"__format__"} | {"data_ptr", "__dlpack__"}

#: what holds this rank's part of the values (a zero2 placeholder's: nothing)
STORAGES = frozenset({"untyped_storage", "storage", "_typed_storage"})

#: what a zero3/hsdp parameter answers from its description alone, by function or property
DESCRIBES = frozenset({
    "shape", "dtype", "is_meta", "size", "dim", "ndim", "numel", "requires_grad",
    "is_leaf", "grad_fn", "layout", "is_floating_point", "is_complex", "element_size",
    "_version", "__repr__", "__format__", "__hash__", "__eq__", "__len__", "is_sparse",
    "itemsize", "nbytes", "names", "_is_view", "is_cuda"})

#: what nn.Module._apply calls (module.to/cpu/cuda/float/...)
CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type",
                         "share_memory_"})

#: copies and reads of all of a parameter's values (a zero3/hsdp rank holds a slice)
WHOLE_VALUES = frozenset({"__deepcopy__", "__reduce_ex__", "__reduce__", "__getstate__",
                          "numpy", "__array__", "tolist", "item", "__float__", "__int__",
                          "__bool__", "__index__"})
