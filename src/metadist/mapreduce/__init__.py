"""Map-reduce task parallelism with TorchOpt's ``torchopt.distributed`` API.

``import metadist.mapreduce as todist`` runs scripts written for TorchOpt's API. Two
engines (``engine=`` of :func:`auto_init_rpc`/:func:`init`, or
``METADIST_MAPREDUCE_ENGINE``): ``"spmd"`` (default; every rank runs the program and parts
are combined with collectives, gradients exact to any order) and ``"rpc"`` (torch RPC and
distributed autograd; rank 0 drives).
"""

from metadist.mapreduce import autograd
from metadist.mapreduce import rpc as rpc
from metadist.mapreduce.parallel import (
    parallelize,
    parallelize_async,
    parallelize_sync,
    remote_async_call,
    remote_sync_call,
)
from metadist.mapreduce.partitioners import (
    DimPartitioner,
    Part,
    Partitioner,
    PartitionFunction,
    batch_partitioner,
    dim_partitioner,
    exclusive_batch_partitioner,
)
from metadist.mapreduce.reducers import mean_reducer, sum_reducer
from metadist.mapreduce.session import (
    ENGINE_ENV,
    ENGINES,
    SessionConfig,
    auto_init_rpc,
    barrier,
    engine,
    init,
    is_driver,
    shutdown,
)
from metadist.mapreduce.spmd import PartFailedError
from metadist.mapreduce.world import (
    WorldInfo,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_worker_id,
    get_world_info,
    get_world_rank,
    get_world_size,
    not_on_rank,
    on_rank,
    rank_non_zero_only,
    rank_zero_only,
)


def is_available() -> bool:
    """Whether both engines can run here (the rpc engine needs torch's RPC)."""
    return autograd.is_available()


__all__ = [
    "ENGINES",
    "ENGINE_ENV",
    "DimPartitioner",
    "Part",
    "PartFailedError",
    "PartitionFunction",
    "Partitioner",
    "SessionConfig",
    "WorldInfo",
    "auto_init_rpc",
    "autograd",
    "barrier",
    "batch_partitioner",
    "dim_partitioner",
    "engine",
    "exclusive_batch_partitioner",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_worker_id",
    "get_world_info",
    "get_world_rank",
    "get_world_size",
    "init",
    "is_available",
    "is_driver",
    "mean_reducer",
    "not_on_rank",
    "on_rank",
    "parallelize",
    "parallelize_async",
    "parallelize_sync",
    "rank_non_zero_only",
    "rank_zero_only",
    "remote_async_call",
    "remote_sync_call",
    "rpc",
    "shutdown",
    "sum_reducer",
]
