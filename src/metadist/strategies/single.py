"""``"single"``: one process, one device. The reference every other strategy must match."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from metadist.strategies.base import Strategy, register
from metadist.strategies.ddp import ReplicatedModule, move_optimizer_state
from metadist.strategies.module import DistributedModule
from metadist.strategies.sync_batchnorm import convert_sync_batchnorm


@register("single")
class SingleStrategy(Strategy):
    """No distribution: moves the model to the device and otherwise stays out of the way."""

    def _setup_module(self, model: nn.Module) -> DistributedModule:
        if self.config.sync_batchnorm:
            model = convert_sync_batchnorm(model)
        return ReplicatedModule(model.to(self.device), None, broadcast_buffers=False)

    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        move_optimizer_state(optimizer)
        return optimizer
