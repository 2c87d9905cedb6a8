"""Fused collectives on lists of tensors: one collective per capped, flat, same-dtype bucket.

Many small collectives cost far more than one large one (hundreds of times on gloo, where
every call pays a round of latency), so lists are flattened into buckets of at most
``bucket_cap_mb``, one collective runs per bucket, and results are written back in place.
Tensors of different dtypes or devices go to different buckets; order within a bucket follows
the input order, so every rank builds the same buckets from the same list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from metadist.comm import ops
from metadist.comm.handle import Handle
from metadist.comm.ops import ReduceOpName
from metadist.runtime.world import Group

DEFAULT_CAP_MB = 25.0


def plan_buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), split where a bucket would exceed
    ``cap_bytes``. A tensor larger than the cap gets a bucket of its own."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    open_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
        members, size = open_buckets.get(key, ([], 0))
        if members and size + nbytes > cap_bytes:
            done.append(members)
            members, size = [], 0
        members.append(i)
        open_buckets[key] = (members, size + nbytes)
    done.extend(members for members, _ in open_buckets.values() if members)
    # Order buckets by their first member so the plan is deterministic and follows the input.
    return sorted(done, key=lambda b: b[0])


def _fused(tensors: Sequence[torch.Tensor], group: Group, bucket_cap_mb: float,
           run: Callable[[torch.Tensor], Handle]) -> Handle:
    parts: list[Handle] = []
    write_back: list[Callable[[], None]] = []
    if ops.group_info(group)[1] == 1:
        return Handle(list(tensors))
    for bucket in plan_buckets(tensors, int(bucket_cap_mb * 2**20)):
        members = [tensors[i] for i in bucket]
        if len(members) == 1 and members[0].is_contiguous():
            parts.append(run(members[0]))
            continue
        flat = torch.cat([t.reshape(-1) for t in members])
        parts.append(run(flat))

        def copy(flat: torch.Tensor = flat, members: list[torch.Tensor] = members) -> None:
            pieces = flat.split([t.numel() for t in members])
            # One fused kernel launch for all copies: per-tensor copy_ calls cost more than the
            # collective itself for hundreds of small tensors.
            torch._foreach_copy_(members, [p.view_as(t) for p, t in zip(pieces, members,
                                                                         strict=True)])

        write_back.append(copy)
    def finish() -> None:
        for copy in write_back:
            copy()

    return Handle(list(tensors), parts, finish)


def fused_all_reduce(tensors: Sequence[torch.Tensor], op: ReduceOpName = "sum", *,
                     group: Group = None, bucket_cap_mb: float = DEFAULT_CAP_MB,
                     async_op: bool = False) -> Handle:
    """All-reduce every tensor of the list in place, one collective per bucket."""
    handle = _fused(tensors, group, bucket_cap_mb,
                    lambda t: ops.all_reduce(t, op, group=group, async_op=True))
    if not async_op:
        handle.wait()
    return handle


def fused_broadcast(tensors: Sequence[torch.Tensor], src: int = 0, *, group: Group = None,
                    bucket_cap_mb: float = DEFAULT_CAP_MB, async_op: bool = False) -> Handle:
    """Broadcast every tensor of the list from group rank ``src``, one collective per bucket."""
    handle = _fused(tensors, group, bucket_cap_mb,
                    lambda t: ops.broadcast(t, src, group=group, async_op=True))
    if not async_op:
        handle.wait()
    return handle


def fused_reduce(tensors: Sequence[torch.Tensor], dst: int = 0, op: ReduceOpName = "sum", *,
                 group: Group = None, bucket_cap_mb: float = DEFAULT_CAP_MB,
                 async_op: bool = False) -> Handle:
    """Reduce every tensor of the list onto group rank ``dst``, one collective per bucket."""
    handle = _fused(tensors, group, bucket_cap_mb,
                    lambda t: ops.reduce(t, dst, op, group=group, async_op=True))
    if not async_op:
        handle.wait()
    return handle
