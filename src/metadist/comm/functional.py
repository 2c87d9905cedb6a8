"""Differentiable collectives: autograd functions whose backward is itself a collective.

Each backward is written with these same functions, so when autograd records the backward
(``create_graph=True``) the double backward is again the right collective, and second-order
gradients (MAML, gradient penalties, unrolled hypergradients) flow across ranks.

Gradient conventions
--------------------
``per_rank`` (default, and what metadist uses internally)
    Every rank r holds its own objective L_r and the quantity being differentiated is the
    global objective  J = sum_r L_r. Backward of all_reduce is all_reduce, of all_gather is
    reduce_scatter, of reduce_scatter is all_gather, of broadcast is a sum onto ``src``.
    This is what data parallelism needs: each rank backpropagates its own loss, and the
    strategy's mean over ranks turns J into the mean objective.
``replicated``
    Every rank holds the *same* objective L (e.g. computed from an all-reduced value). The
    backward of all_reduce is then the identity (divided by N for ``mean``), of all_gather a
    slice, of broadcast the identity on ``src`` and zero elsewhere: no communication.
    reduce_scatter has rank-specific outputs, so only ``per_rank`` applies to it.

Collectives in backward run only where autograd reaches them, so every rank must
differentiate the same graph shape (the usual SPMD rule); gradients that autograd would
leave as ``None`` are materialised as zeros so no rank skips its part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.autograd.function import FunctionCtx

from metadist.comm import ops
from metadist.comm.fused import plan_buckets
from metadist.runtime.world import Group

Convention = Literal["per_rank", "replicated"]
CONVENTIONS = ("per_rank", "replicated")
DifferentiableOp = Literal["sum", "mean"]


def _validate(op: str | None, convention: str) -> None:
    if op is not None and op not in ("sum", "mean"):
        raise ValueError(f"differentiable reduce op {op!r} is not supported; choose sum or mean")
    if convention not in CONVENTIONS:
        raise ValueError(f"convention {convention!r} is not known; choose one of: "
                         f"{', '.join(CONVENTIONS)}")


def _plain_empty(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A new buffer of ``like``'s dtype and device, a plain tensor whatever ``like``'s class
    (a collective's result is whole data, not the tensor subclass it came from)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    return torch.clone(x, memory_format=torch.contiguous_format)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, op: str, group: Group,
                convention: str) -> torch.Tensor:
        ctx.op, ctx.group, ctx.convention = op, group, convention  # type: ignore[attr-defined]
        y = _contiguous_copy(x)
        ops.all_reduce(y, op, group=group)  # type: ignore[arg-type]
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.convention == "per_rank":
            return _AllReduce.apply(g, ctx.op, ctx.group, ctx.convention), None, None, None
        size = ops.group_info(ctx.group)[1]
        return (g / size if ctx.op == "mean" else g), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: Group, convention: str) -> torch.Tensor:
        ctx.group, ctx.convention = group, convention  # type: ignore[attr-defined]
        size = ops.group_info(group)[1]
        out = _plain_empty(x, (size * x.shape[0], *x.shape[1:]))
        ops.all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.convention == "per_rank":
            return _ReduceScatter.apply(g, "sum", ctx.group), None, None
        _, size, rank = ops.group_info(ctx.group)
        m = g.shape[0] // size
        return g.narrow(0, rank * m, m), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, op: str, group: Group,
                scratch: bool = False) -> torch.Tensor:
        ctx.op, ctx.group = op, group  # type: ignore[attr-defined]
        size = ops.group_info(group)[1]
        if x.shape[0] % size:
            raise ValueError(f"reduce_scatter: dim 0 ({x.shape[0]}) must divide by the group "
                             f"size {size}; pad the input")
        out = _plain_empty(x, (x.shape[0] // size, *x.shape[1:]))
        work = x if scratch and x.is_contiguous() else _contiguous_copy(x)
        ops.reduce_scatter(out, work, op, group=group,  # type: ignore[arg-type]
                           input_is_scratch=True)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        full = _AllGather.apply(g, ctx.group, "per_rank")
        if ctx.op == "mean":
            full = full / ops.group_info(ctx.group)[1]
        return full, None, None, None


class _ReduceScatterParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, group: Group, *parts: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.sizes = group, [p.numel() for p in parts]  # type: ignore[attr-defined]
        size = ops.group_info(group)[1]
        out = _plain_empty(parts[0], (sum(ctx.sizes) // size,))  # type: ignore[attr-defined]
        ops.reduce_scatter_parts(out, [p.reshape(-1) for p in parts], group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full = _AllGather.apply(g, ctx.group, "per_rank")
        return (None, *full.split(ctx.sizes))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, src: int, group: Group,
                convention: str) -> torch.Tensor:
        ctx.src, ctx.group, ctx.convention = src, group, convention  # type: ignore[attr-defined]
        y = _contiguous_copy(x)
        ops.broadcast(y, src, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        is_src = ops.group_info(ctx.group)[2] == ctx.src
        if ctx.convention == "per_rank":
            total = _AllReduce.apply(g, "sum", ctx.group, "per_rank")
            # Multiply rather than replace on non-src ranks: the graph keeps the all_reduce on
            # every rank, so a double backward runs the same collective everywhere.
            return (total if is_src else total * 0.0), None, None, None
        return (g if is_src else g * 0.0), None, None, None


def all_reduce(x: torch.Tensor, op: DifferentiableOp = "sum", *, group: Group = None,
               convention: Convention = "per_rank") -> torch.Tensor:
    """Differentiable all-reduce (``sum`` or ``mean``); returns a new tensor."""
    _validate(op, convention)
    out: torch.Tensor = _AllReduce.apply(x, op, group, convention)
    return out


def all_gather(x: torch.Tensor, *, group: Group = None,
               convention: Convention = "per_rank") -> torch.Tensor:
    """Differentiable all-gather along dim 0: ``(N * x.shape[0], *x.shape[1:])``."""
    _validate(None, convention)
    out: torch.Tensor = _AllGather.apply(x, group, convention)
    return out


def reduce_scatter(x: torch.Tensor, op: DifferentiableOp = "sum", *,
                   group: Group = None, input_is_scratch: bool = False) -> torch.Tensor:
    """Differentiable reduce-scatter along dim 0 (``per_rank`` convention).
    ``input_is_scratch``: ``x`` is a temporary nothing else reads (its backward saves
    nothing), so the reduction may work in it instead of a copy."""
    _validate(op, "per_rank")
    out: torch.Tensor = _ReduceScatter.apply(x, op, group, input_is_scratch)
    return out


def reduce_scatter_parts(parts: Sequence[torch.Tensor], *,
                         group: Group = None) -> torch.Tensor:
    """Differentiable sum-reduce-scatter of the concatenation of 1-D contiguous ``parts``
    (of the same sizes on every rank) without building it (``ops.reduce_scatter_parts``);
    the backward hands each part its slice of the all-gathered gradient."""
    out: torch.Tensor = _ReduceScatterParts.apply(group, *parts)
    return out


def broadcast(x: torch.Tensor, src: int = 0, *, group: Group = None,
              convention: Convention = "per_rank") -> torch.Tensor:
    """Differentiable broadcast from group rank ``src`` (``x`` has one shape on every rank)."""
    _validate(None, convention)
    out: torch.Tensor = _Broadcast.apply(x, src, group, convention)
    return out


def all_reduce_many(tensors: Sequence[torch.Tensor], op: DifferentiableOp = "sum", *,
                    group: Group = None, convention: Convention = "per_rank",
                    bucket_cap_mb: float = 256.0) -> list[torch.Tensor]:
    """Differentiable all-reduce of a list, fused into one collective per dtype/device bucket."""
    _validate(op, convention)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for bucket in plan_buckets(tensors, int(bucket_cap_mb * 2**20)):
        members = [tensors[i] for i in bucket]
        flat = torch.cat([t.reshape(-1) for t in members])
        reduced = all_reduce(flat, op, group=group, convention=convention)
        for i, piece in zip(bucket, reduced.split([t.numel() for t in members]), strict=True):
            out[i] = piece.view_as(tensors[i])
    return [t for t in out if t is not None]
