"""The two conjugate differentiable operations of the spmd engine.

Under spmd every rank runs the same program, so a tensor is either *replicated* (the same on
every rank: parameters, the reduced loss) or *local* (a part's result, known to the rank that
computed it). Two maps connect them, each the other's adjoint:

``tie``  (replicated -> local): forward is the identity; backward sums the ranks' local
         gradients, because each rank's parts contributed only their share of the gradient
         of a parameter that is one variable in the single-process program.
``sum``  (local -> replicated): forward adds the ranks' contributions; backward hands every
         rank the (replicated) gradient unchanged.

Each backward is written with the other map, so autograd records it when ``create_graph`` is
set and higher derivatives cross ranks correctly too (Megatron-LM's copy/reduce pair). Neither
of ``comm.functional``'s conventions fits alone: ``per_rank`` would be exact with an extra
collective and an N-fold scaling to undo; ``replicated`` hands back a plain identity whose own
backward never sums, which is wrong once a second-order gradient arrives rank-specific.

A backward that reaches ``tie`` on one rank must reach it on all (it runs a collective);
callers anchor every tie into the results so that it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from metadist.comm import ops
from metadist.comm.fused import DEFAULT_CAP_MB, plan_buckets

GATHER_MAX_BYTES = 1 << 20


def _sum_flat(flat: torch.Tensor, world: int) -> torch.Tensor:
    """Sum over ranks. At two ranks, or for small buffers, gather and add in rank order:
    the same bytes as a ring all-reduce at two ranks, far less latency on gloo (one exchange
    against an all-reduce's rounds), and every rank adds the same numbers in the same order."""
    if world == 2 or flat.numel() * flat.element_size() <= GATHER_MAX_BYTES:
        every = flat.new_empty(world * flat.numel())
        ops.all_gather(every, flat)
        return every.view(world, -1).sum(dim=0)
    ops.all_reduce(flat, "sum")
    return flat


def _all_reduce_sum(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    world = ops.group_info(None)[1]
    if world == 1:
        return [t.clone() for t in tensors]
    out: list[torch.Tensor] = list(tensors)
    for bucket in plan_buckets(out, int(DEFAULT_CAP_MB * 2**20)):
        members = [tensors[i] for i in bucket]
        flat = _sum_flat(torch.cat([t.reshape(-1) for t in members]), world)  # cat: a new buffer
        for i, piece in zip(bucket, flat.split([t.numel() for t in members]), strict=True):
            out[i] = piece.view_as(tensors[i])
    return out


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: tuple[torch.Tensor, ...] = _Sum.apply(*grads)
        return out


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_all_reduce_sum(tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: tuple[torch.Tensor, ...] = _Tie.apply(*grads)
        return out


def tie(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Replicated tensors as local ones: same values, gradients summed over ranks."""
    return list(_Tie.apply(*tensors)) if tensors else []


def sum_over_ranks(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Local contributions added over ranks (one fused all-reduce per dtype)."""
    return list(_Sum.apply(*tensors)) if tensors else []


def _zero_linked_to(like: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``like`` that autograd still sees as depending on ``source``.

    The sum of an empty slice is exactly 0 (no NaN even if ``source`` holds one)."""
    return torch.zeros_like(like) + source.reshape(-1)[:0].sum().to(like.dtype)


class _Combine(torch.autograd.Function):
    """``sum`` of zero-padded local parts, with the forward values already known.

    Every rank learned every part's values from the byte exchange, so the forward needs no
    collective; mathematically it is ``sum`` of each rank's parts padded with zeros, and the
    backward is that map's adjoint: ``tie`` of every output gradient, then this rank's parts.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, values: list[torch.Tensor], mine: list[int], n_anchors: int,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.mine, ctx.n_anchors = mine, n_anchors  # type: ignore[attr-defined]
        ctx.save_for_backward(*inputs[len(mine):])
        return tuple(values)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tied = tie(grads)
        anchors = ctx.saved_tensors
        # An anchor's zero gradient still depends on the tie, so a double backward reaches the
        # tie (and its collective) on ranks that computed no part.
        linked = [_zero_linked_to(a, tied[0]) for a in anchors]
        return (None, None, None, *[tied[j] for j in ctx.mine], *linked)


def combine(values: list[torch.Tensor], local: list[torch.Tensor], mine: list[int],
            anchors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Global part results ``values`` as a differentiable function of this rank's parts.

    ``local[k]`` is this rank's result at output ``mine[k]``. ``anchors`` (tied tensors)
    make the outputs depend on every tie on every rank, even one that computed no part.
    """
    if not values:
        return []
    out: tuple[torch.Tensor, ...] = _Combine.apply(values, mine, len(anchors), *local, *anchors)
    return list(out)


__all__ = ["combine", "sum_over_ranks", "tie"]
