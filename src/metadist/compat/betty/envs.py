"""Betty's ``betty.envs.Env``: shared state (e.g. an RL environment or a data stream) that
every problem reaches as ``self.env`` and that reaches every problem by name."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from metadist.strategies.registry import strategy as make_strategy


class Env:
    """Subclass it; ``train_data_loader`` (if set) is split across ranks like a problem's."""

    env: Any = None
    train_data_loader: Any = None
    device: Any = None
    accelerator: Any = None  # Betty's, set only under its "accelerate" strategy
    _strategy: str | None = None
    _world_size: int | None = None
    _rank: int | None = None
    _local_rank: int | None = None

    def initialize(self) -> None:
        if self.train_data_loader is not None:
            self.train_data_loader = self.patch_data_loader(self.train_data_loader)

    def patch_module(self, module: nn.Module) -> nn.Module:
        """``module`` set up by the engine's strategy (moved to the device, synced)."""
        return make_strategy(self._strategy or "single").setup_module(module)

    def patch_data_loader(self, loader: Any) -> Any:
        if not isinstance(loader, DataLoader):
            return loader
        return make_strategy(self._strategy or "single").setup_dataloader(loader)

    def configure_device(self, device: Any) -> None:
        self.device = device

    def configure_distributed_training(self, dictionary: dict[str, Any]) -> None:
        self._strategy = dictionary["strategy"]
        self._world_size = dictionary["world_size"]
        self._rank = dictionary["rank"]
        self._local_rank = dictionary["local_rank"]
