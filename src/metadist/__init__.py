"""metadist: from one PyTorch process to many with a one-line strategy switch, with
meta-learning gradients kept exact under data parallelism and sharding."""


from metadist import checkpoint, comm, mapreduce, meta
from metadist.checkpoint import CheckpointError
from metadist.comm.ops import barrier as _barrier
from metadist.errors import (
    CollectiveFailedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    LaunchTimeoutError,
    MetadistError,
    NotInitializedError,
    RankFailedError,
    RendezvousError,
    WorldMismatchError,
)
from metadist.precision import LossScaler
from metadist.runtime import resident as _resident
from metadist.runtime.ranks import (
    get_logger,
    not_on_rank,
    on_rank,
    rank_non_zero_only,
    rank_zero_only,
)
from metadist.runtime.ranks import (
    print as print,  # re-exported (a redundant alias tells linters so)
)
from metadist.runtime.spawn import RankPool, launch
from metadist.runtime.world import (
    SELF,
    World,
    cross_node_group,
    init,
    is_initialized,
    node_group,
    shutdown,
    world,
)
from metadist.strategies import (
    DistributedModule,
    Strategy,
    SyncBatchNorm,
    deferred_init,
    strategy,
)

__version__ = "0.1.0"

_resident.apply()  # importing allocates no tensor: still before the first (runtime/resident.py)


def barrier() -> None:
    """Block until every rank of the job reaches this call."""
    _barrier()


# `print` is public as metadist.print but left out of __all__: a star import must not shadow
# the builtin.
__all__ = [
    "SELF",
    "CheckpointError",
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistributedModule",
    "LaunchTimeoutError",
    "LossScaler",
    "MetadistError",
    "NotInitializedError",
    "RankFailedError",
    "RankPool",
    "RendezvousError",
    "Strategy",
    "SyncBatchNorm",
    "World",
    "WorldMismatchError",
    "__version__",
    "barrier",
    "checkpoint",
    "comm",
    "cross_node_group",
    "deferred_init",
    "get_logger",
    "init",
    "is_initialized",
    "launch",
    "mapreduce",
    "meta",
    "node_group",
    "not_on_rank",
    "on_rank",
    "rank_non_zero_only",
    "rank_zero_only",
    "shutdown",
    "strategy",
    "world",
]
