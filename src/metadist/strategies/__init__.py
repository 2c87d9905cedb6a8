"""Strategies: one file each (zero3/hsdp: a package), one registry, one small interface
(see base.py)."""

from metadist.strategies import ddp, dp, single, zero, zero3
from metadist.strategies.base import Strategy, StrategyConfig
from metadist.strategies.batchnorm.sync import SyncBatchNorm, convert_sync_batchnorm
from metadist.strategies.bind import bind_parameters
from metadist.strategies.deferred import deferred_init
from metadist.strategies.module import DistributedModule
from metadist.strategies.registry import available, register, strategy
from metadist.strategies.tensors.elsewhere import ElsewhereGrad, held_grad
from metadist.strategies.zero3 import hsdp as _hsdp  # noqa: F401  (registers hsdp)
from metadist.strategies.zero3 import strategy as _zero3  # noqa: F401  (registers zero3/fsdp)

__all__ = [
    "DistributedModule",
    "ElsewhereGrad",
    "Strategy",
    "StrategyConfig",
    "SyncBatchNorm",
    "available",
    "bind_parameters",
    "convert_sync_batchnorm",
    "ddp",
    "deferred_init",
    "dp",
    "held_grad",
    "register",
    "single",
    "strategy",
    "zero",
    "zero3",
]
