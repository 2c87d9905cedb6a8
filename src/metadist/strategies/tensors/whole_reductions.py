"""A reduction of a whole tensor that ranks hold parts of, computed as one process computes it.

[Note: whole reductions]
A zero3/hsdp flat shard is this rank's slice of one unit's parameters laid end to end (the
last rank's slice padded); a zero2 gradient is held whole by its parameter's owner and by no
other rank. Either way a reduction over *all* of the tensor's elements (``g.sum()``,
``g.norm()``, ``g.abs().max()``, ``torch.linalg.vector_norm(g)``, ``g.isfinite().all()``) has
one meaning in one process: the same reduction over every element of the whole. So it is
computed as that: the elements this rank holds (padding left out; none for a gradient
another rank owns) reduced here, then combined over the group in one all-reduce, and every
rank returns the same plain tensor. Every rank runs a program's loop over
``model.parameters()`` alike, so the all-reduces pair. A gradient norm written by hand
thereby equals one process's, and a logged largest gradient is the largest one.

Inside an optimizer's step (torch.optim on the stack) and in metadist's own code the
reduction stays this rank's: a zero2 optimizer steps only the parameters its rank owns, so a
collective there would not pair, and a per-parameter norm there (LAMB) is one process's
already; a zero3 shard's is refused there as before (shard_value.py).

Only values that no gradient flows back through are reduced so (a shard's gradient, anything
computed under ``torch.no_grad()`` or from detached values): a differentiable global value
would send a gradient to every rank's shard from one rank's loss, which one process's
objective does not. Reductions along a dimension, and anything else across elements, still
stop (shard_value.py).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from metadist.comm import ops
from metadist.comm.ops import ReduceOpName
from metadist.runtime.world import Group
from metadist.strategies.tensors.policy import READS, WHOLE


@dataclass(frozen=True)
class Span:
    """Where a tensor's elements lie: the group holding it, how many of this rank's
    elements count (the first ``valid`` of the flattened local tensor: padding and a
    gradient another rank owns count none), and the whole tensor's size."""

    group: Group
    valid: int
    numel: int
    #: the group rank that holds the whole (zero2's owner); None where ranks hold slices
    owner: int | None = None
    #: collective: the whole tensor from this rank's part (a value of the local shape),
    #: where ranks hold slices whose places are known (zero3/hsdp parameters, flat shards)
    assemble: Callable[[Tensor], Tensor] | None = field(default=None, compare=False)


#: packages whose own code works on this rank's part as it is
OWNERS = ("metadist.strategies.", "metadist.checkpoint.", "metadist.comm.",
          "metadist.runtime.", "metadist.meta.", "metadist.testing", "metadist.precision",
          "metadist.scaler")


#: modules whose frames stand for their caller's: a zero3 parameter runs its caller's call
#: on this rank's slice of it (strategies/zero3/sharded_param.py)
TRANSPARENT = ("metadist.strategies.zero3.sharded_param",)


def _caller_module(frame: FrameType | None) -> tuple[str, FrameType | None]:
    """The module of the first frame from ``frame`` on outside torch (and outside the
    transparent modules), and that frame."""
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not (module == "torch" or module.startswith("torch.") or module in TRANSPARENT):
            return module, frame
        frame = frame.f_back
    return "", None


def called_by_owner(skip: int = 2) -> bool:
    """Whether the first frame outside torch that led to the intercepted call belongs to a
    package that owns shards (``skip``: the interception's own frames)."""
    return _caller_module(sys._getframe(skip))[0].startswith(OWNERS)


def local_caller(skip: int = 2) -> bool:
    """Whether the call being intercepted reads this rank's part as it is: it runs inside an
    optimizer's step, or the first frame outside torch that led to it is metadist's own."""
    frame: FrameType | None = sys._getframe(skip)
    if _caller_module(frame)[0].startswith(OWNERS):
        return True
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("torch.optim"):
            return True
        frame = frame.f_back
    return False


def span_of(t: Any) -> Span | None:
    """The span a shard, its gradient or a value computed element by element from them
    carries (None: anything else)."""
    span = getattr(t, "_metadist_span", None)
    return span if isinstance(span, Span) else None


def carry(out: Any, args: Any, kwargs: Any) -> None:
    """Give the outputs of an element-wise call the span of its first shard argument (the
    same shape: the same elements of the same unit)."""
    source = next((t for t in tree_flatten((args, kwargs))[0] if span_of(t) is not None), None)
    if source is None:
        return
    span = span_of(source)
    for t in tree_flatten(out)[0]:
        if isinstance(t, Tensor) and t is not source and t.shape == source.shape:
            t._metadist_span = span  # type: ignore[attr-defined]


def full_of(x: Tensor) -> Tensor:
    """Collective over ``x``'s group, as DTensor's ``full_tensor``: the whole tensor ``x`` is
    this rank's part of (a zero2 gradient: its owner's values; a zero3/hsdp gradient, slice
    or value computed from one element by element: the ranks' slices put together). Values,
    not differentiable."""
    span = span_of(x)
    if span is None or (span.owner is None and span.assemble is None):
        raise ValueError(
            "full_tensor() of a tensor whose place in a whole is not known (not a zero2 or "
            "zero3/hsdp gradient, a parameter's slice, or a value of the same shape computed "
            "from one element by element); use p.full_tensor() of a parameter or "
            "model.full_parameters()")
    with torch._C.DisableTorchFunctionSubclass():
        local = x.detach().as_subclass(Tensor)
        if span.owner is None:
            assert span.assemble is not None
            return span.assemble(local)
        values = (local.contiguous().clone() if span.valid
                  else torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device))
    ops.broadcast(values, span.owner, group=span.group)
    return values




def read_whole(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """``(True, value)``: ``name`` read from the owner's values of a tensor one rank holds
    whole (a zero2 gradient, or a value of its shape computed from it), broadcast to every
    rank; ``(False, None)`` where it is not such a read."""
    x = args[0] if args else None
    span = span_of(x)
    if (name not in READS or span is None or span.owner is None or not isinstance(x, Tensor)
            or (x.requires_grad and torch.is_grad_enabled())):
        return False, None
    with torch._C.DisableTorchFunctionSubclass():
        values = (x.detach().as_subclass(Tensor).contiguous().clone() if span.valid
                  else torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device))
    ops.broadcast(values, span.owner, group=span.group)
    return True, getattr(values, name)(*args[1:], **kwargs)


def reduce_whole(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """``name(*args, **kwargs)`` over the whole unit where it is a whole reduction of one
    shard value that needs no gradient (module notes); None where it is not."""
    if name not in WHOLE or not args or not isinstance(args[0], Tensor):
        return None
    x, rest = args[0], args[1:]
    span = span_of(x)
    if span is None or (x.requires_grad and torch.is_grad_enabled()):
        return None
    if any(isinstance(t, Tensor) for t in tree_flatten((rest, kwargs))[0]):
        return None
    with torch._C.DisableTorchFunctionSubclass():
        local = (x.detach().as_subclass(Tensor).reshape(-1)[:span.valid] if span.valid
                 else torch.empty(0, dtype=x.dtype, device=x.device))
        return _reduce(name, local, rest, kwargs, span)


def _reduce(name: str, v: Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any],
            span: Span) -> Tensor | None:
    options = dict(kwargs)
    if options.pop("dim", None) is not None or options.pop("keepdim", False):
        return None
    match name:
        case "sum" | "mean":
            if rest:
                return None
            dtype = options.pop("dtype", None)
            if options:
                return None
            total = _all_reduce(v.sum(dtype=dtype) if dtype is not None else v.sum(), "sum", span)
            return total / span.numel if name == "mean" else total
        case "norm" | "vector_norm" | "linalg_vector_norm":
            p = rest[0] if rest else options.pop("p", options.pop("ord", 2))
            dtype = options.pop("dtype", None)
            if len(rest) > 1 or options:
                return None
            return _norm(v if dtype is None else v.to(dtype), p, span)
        case "amax" | "amin" | "max" | "min":
            if rest or options:
                return None
            largest = name in ("amax", "max")
            empty = torch.tensor(-math.inf if largest else math.inf, dtype=v.dtype,
                                 device=v.device)
            part = (v.amax() if largest else v.amin()) if v.numel() else empty
            return _all_reduce(part, "max" if largest else "min", span)
        case "count_nonzero":
            if rest or options:
                return None
            return _all_reduce(torch.count_nonzero(v), "sum", span)
        case "all" | "any":
            if rest or options:
                return None
            part = (v.all() if name == "all" else v.any()).to(torch.int32)
            return _all_reduce(part, "min" if name == "all" else "max", span).to(torch.bool)
    return None


def _norm(v: Tensor, p: Any, span: Span) -> Tensor | None:
    if p == "fro":
        p = 2
    if not isinstance(p, int | float) or isinstance(p, bool):
        return None
    a = v.abs()
    if p == math.inf:
        part = a.amax() if a.numel() else torch.zeros((), dtype=a.dtype, device=a.device)
        return _all_reduce(part, "max", span)
    if p == -math.inf or p < 0:
        return None
    if p == 0:
        return _all_reduce(torch.count_nonzero(v).to(v.dtype), "sum", span)
    total = _all_reduce(a.pow(p).sum(), "sum", span)
    return total.sqrt() if p == 2 else total.pow(1.0 / p)


def _all_reduce(t: Tensor, op: ReduceOpName, span: Span) -> Tensor:
    t = t.clone()
    ops.all_reduce(t, op, group=span.group)
    return t
