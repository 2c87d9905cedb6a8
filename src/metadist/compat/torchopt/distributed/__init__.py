"""TorchOpt's ``torchopt.distributed`` (0.7.3) on metadist's map-reduce engines.

Change ``import torchopt.distributed as todist`` to
``import metadist.compat.torchopt.distributed as todist`` (and ``from torchopt.distributed
import api, autograd, world`` likewise): every public name is here with TorchOpt's
signatures, defaults and split/reduce rules, and ``todist.rpc`` is ``torch.distributed.rpc``.

TorchOpt's layout (rank 0 drives under ``@todist.rank_zero_only`` inside
``@todist.auto_init_rpc()``, the other ranks serve; ``todist.rpc.RRef(net)``) runs under
``metadist run --nproc N`` as it is: this layer starts metadist's ``"rpc"`` engine by default,
where metadist's own API (:mod:`metadist.mapreduce`) defaults to ``"spmd"``. See
``_session`` for the engine choice and for the shutdown at exit.
"""

from torch import distributed as dist
from torch.distributed import rpc as rpc

from metadist.compat.torchopt._names import present_loaded
from metadist.compat.torchopt.distributed import api as api
from metadist.compat.torchopt.distributed import autograd as autograd
from metadist.compat.torchopt.distributed import world as world
from metadist.compat.torchopt.distributed.api import (
    TensorDimensionPartitioner,
    batch_partitioner,
    dim_partitioner,
    mean_reducer,
    parallelize,
    parallelize_async,
    parallelize_sync,
    remote_async_call,
    remote_sync_call,
    sum_reducer,
)
from metadist.compat.torchopt.distributed.world import (
    auto_init_rpc,
    barrier,
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

present_loaded()  # TorchOpt's module paths (_names.py)


def is_available() -> bool:
    """Whether torch.distributed, its RPC and its distributed autograd are built in."""
    return bool(dist.is_available() and rpc.is_available() and autograd.is_available())


__all__ = [
    "TensorDimensionPartitioner",
    "auto_init_rpc",
    "barrier",
    "batch_partitioner",
    "dim_partitioner",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_worker_id",
    "get_world_info",
    "get_world_rank",
    "get_world_size",
    "is_available",
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
    "sum_reducer",
]
