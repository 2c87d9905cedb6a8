"""Strategies: one file each, one registry, one small interface (see base.py)."""

from metadist.strategies import ddp, dp, fsdp, hsdp, single, zero
from metadist.strategies.base import Strategy, StrategyConfig, available, register, strategy
from metadist.strategies.bind import bind_parameters
from metadist.strategies.deferred import deferred_init
from metadist.strategies.elsewhere import ElsewhereGrad, held_grad
from metadist.strategies.module import DistributedModule
from metadist.strategies.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

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
    "fsdp",
    "held_grad",
    "hsdp",
    "register",
    "single",
    "strategy",
    "zero",
]
