"""``fairscale.nn.checkpoint`` on metadist."""

from metadist.compat.fairscale.nn.checkpoint.checkpoint_activations import (
    checkpoint_wrapper,
    is_checkpointing,
    is_recomputing,
)

__all__ = ["checkpoint_wrapper", "is_checkpointing", "is_recomputing"]
