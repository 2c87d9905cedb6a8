"""FairScale's ``checkpoint_wrapper``: metadist's activation-checkpointing wrapper.

The wrapped module's activations are recomputed in backward (metadist's wrapper, which
composes with every strategy and with fast weights). ``offload_to_cpu=True`` also keeps the
tensors the recomputation starts from in CPU memory between the forward and the backward
(torch's ``save_on_cpu``) where the module runs on an accelerator; on the CPU they are
there already.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from metadist.strategies.activation import CheckpointWrapper

_checkpointing = False  # inside a checkpointed forward (FairScale's is_checkpointing)


class OffloadingCheckpointWrapper(CheckpointWrapper):
    """:class:`CheckpointWrapper` that can keep what it saves in CPU memory."""

    def __init__(self, module: nn.Module, offload_to_cpu: bool = False) -> None:
        super().__init__(module)
        self.offload_to_cpu = offload_to_cpu

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        global _checkpointing
        offload = self.offload_to_cpu and any(
            p.device.type != "cpu" for p in self.checkpointed.parameters())
        before, _checkpointing = _checkpointing, True
        try:
            with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else nullcontext():
                return super().forward(*args, **kwargs)
        finally:
            _checkpointing = before


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """``module`` with its activations recomputed in backward (state-dict keys unchanged)."""
    return OffloadingCheckpointWrapper(module, offload_to_cpu)


def is_checkpointing() -> bool:
    """Whether a checkpointed module's forward is running."""
    return _checkpointing and torch.is_grad_enabled()


def is_recomputing() -> bool:
    """Whether a checkpointed module's forward is being recomputed in backward."""
    return _checkpointing and torch._C._current_graph_task_id() != -1


__all__ = ["checkpoint_wrapper", "is_checkpointing", "is_recomputing"]
