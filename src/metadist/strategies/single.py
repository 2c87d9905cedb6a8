"""``"single"``: one process, one device. The reference every other strategy must match."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from metadist.strategies.base import Strategy
from metadist.strategies.batchnorm.sync import convert_sync_batchnorm
from metadist.strategies.ddp import ReplicatedModule, move_optimizer_state
from metadist.strategies.module import DistributedModule
from metadist.strategies.registry import register


@register("single", "default")
class SingleStrategy(Strategy):
    """No distribution: moves the model to the device and otherwise stays out of the way."""

    def _setup_module(self, model: nn.Module) -> DistributedModule:
        size = self.world.world_size
        if size > 1:
            # Every rank would train its own model on its own data, never syncing: a silent
            # N-fold job that looks like a distributed one.
            raise ValueError(
                f"strategy 'single' runs one process, but this job has {size} ranks: each would "
                "train its own copy of the model without ever syncing. Use a distributed "
                "strategy (e.g. metadist.strategy('ddp')), launch one process, or, for "
                "independent runs on purpose, set METADIST_LAUNCHER=single in each process")
        if self.config.sync_batchnorm:
            model = convert_sync_batchnorm(model)
        return ReplicatedModule(model.to(self.device), None, broadcast_buffers=False)

    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        move_optimizer_state(optimizer)
        return optimizer
