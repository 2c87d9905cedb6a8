"""FairScale's ``ShardedGradScaler``: torch's loss scaler, with every rank's overflow counted.

Where gradients or optimizer state are sharded, each rank unscales and checks only the
gradients it holds; a step skipped on one rank must be skipped on all of them, or the
ranks' parameters part. So the overflow flags are reduced (max) over the ranks before the
step decides. (FairScale's own disables itself without CUDA; this one scales on the CPU too,
which changes no float32 number: the scale is a power of two.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

import metadist
from metadist.comm import ops
from metadist.compat.fairscale._options import check_group


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` on the job's device whose overflow check is global."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, process_group: Any = None) -> None:
        check_group(process_group, "ShardedGradScaler")
        super().__init__(metadist.init().device.type, init_scale=init_scale,
                         growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)

    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled:
            return
        for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            ops.all_reduce(found, "max")


#: FairScale's ``GradScaler`` (torch's, for one process's optimizer)
GradScaler = ShardedGradScaler

__all__ = ["GradScaler", "ShardedGradScaler"]
