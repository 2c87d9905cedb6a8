"""``fairscale.nn.data_parallel`` on metadist."""

from metadist.compat.fairscale.nn.data_parallel.fully_sharded_data_parallel import (
    FullyShardedDataParallel,
)
from metadist.compat.fairscale.nn.data_parallel.sharded_ddp import ShardedDataParallel

__all__ = ["FullyShardedDataParallel", "ShardedDataParallel"]
