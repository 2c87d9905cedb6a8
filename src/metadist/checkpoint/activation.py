"""``metadist.checkpoint.activation``: the name activation checkpointing was first documented
under. It lives beside the strategies that apply it (``metadist.strategies.activation``)."""

from metadist.strategies.activation import (
    CheckpointPolicy,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

__all__ = ["CheckpointPolicy", "apply_activation_checkpointing", "checkpoint_wrapper"]
