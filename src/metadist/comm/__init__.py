"""Everything that moves bytes between ranks: collectives, fused and differentiable variants,
point-to-point sends, and the counters that benchmarks read. A program calls the names here
(each returns its result, a handle only with ``async_op=True``: api.py); metadist's own code
calls ``comm.ops`` (a handle always), never torch.distributed."""

from metadist.comm import functional, stats
from metadist.comm.api import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from metadist.comm.fused import fused_all_reduce, fused_broadcast, fused_reduce, plan_buckets
from metadist.comm.handle import Handle
from metadist.comm.ops import (
    REDUCE_OPS,
    ReduceOpName,
    all_gather_object,
    backend_of,
    barrier,
    broadcast_object,
    debug_enabled,
    gather_object,
    group_info,
    set_debug,
)
from metadist.runtime.world import SELF, Group

__all__ = [
    "REDUCE_OPS",
    "SELF",
    "Group",
    "Handle",
    "ReduceOpName",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "backend_of",
    "barrier",
    "broadcast",
    "broadcast_object",
    "debug_enabled",
    "functional",
    "fused_all_reduce",
    "fused_broadcast",
    "fused_reduce",
    "gather",
    "gather_object",
    "group_info",
    "irecv",
    "isend",
    "plan_buckets",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "set_debug",
    "stats",
]
