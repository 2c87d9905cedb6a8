"""Everything that moves bytes between ranks: collectives, fused and differentiable variants,
and the counters that benchmarks read. Strategies call these, never torch.distributed."""

from metadist.comm import functional, stats
from metadist.comm.fused import fused_all_reduce, fused_broadcast, fused_reduce, plan_buckets
from metadist.comm.handle import Handle
from metadist.comm.ops import (
    REDUCE_OPS,
    ReduceOpName,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    backend_of,
    barrier,
    broadcast,
    broadcast_object,
    debug_enabled,
    gather,
    gather_object,
    group_info,
    reduce,
    reduce_scatter,
    scatter,
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
    "plan_buckets",
    "reduce",
    "reduce_scatter",
    "scatter",
    "set_debug",
    "stats",
]
