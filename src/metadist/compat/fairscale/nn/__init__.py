"""``fairscale.nn`` on metadist."""

from metadist.compat.fairscale.nn.checkpoint import checkpoint_wrapper
from metadist.compat.fairscale.nn.data_parallel import (
    FullyShardedDataParallel,
    ShardedDataParallel,
)
from metadist.compat.fairscale.nn.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    wrap,
)

__all__ = ["FullyShardedDataParallel", "ShardedDataParallel", "auto_wrap", "checkpoint_wrapper",
           "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap", "wrap"]
