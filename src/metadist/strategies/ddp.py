"""``"ddp"``: every rank holds the whole model; gradients are averaged in buckets that overlap
backward. Our own reducer (strategies/buckets.py), driven by backward, never by forward, so
inner loops with any number of forwards and ``autograd.grad(create_graph=True)`` just work."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.comm import fused
from metadist.strategies import step_chain
from metadist.strategies.base import Strategy, StrategyConfig
from metadist.strategies.batchnorm.sync import convert_sync_batchnorm
from metadist.strategies.buckets import Reducer
from metadist.strategies.module import DistributedModule
from metadist.strategies.registry import register


@dataclass(frozen=True)
class DDPConfig(StrategyConfig):
    #: Cap of a gradient bucket; buckets launch their all-reduce as soon as they are full.
    bucket_cap_mb: float = 25.0
    #: Cap of the first bucket (the last layers' gradients), small so communication starts early.
    first_bucket_mb: float = 1.0
    #: Broadcast rank 0's buffers (e.g. BatchNorm running stats) before every forward.
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("bucket_cap_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite positive number of MiB, got "
                                 f"{value!r} (e.g. {name}=25.0)")


class ReplicatedModule(DistributedModule):
    """The user's module, replicated on every rank, with a reducer for its gradients."""

    def __init__(self, module: nn.Module, reducer: Reducer | None, broadcast_buffers: bool) -> None:
        super().__init__(module)
        self.reducer = reducer
        self._broadcast_buffers = broadcast_buffers and reducer is not None

    def _dtype_bound_state(self) -> str | None:
        return "gradient buckets" if self.reducer is not None else None

    def pre_functional_forward(self) -> None:
        """Nothing: a forward on given parameters computes this rank's own task, which may
        run on one rank and not another (no collective)."""

    def pre_forward(self) -> None:
        # Rank 0's buffers, as torch DDP broadcasts them, except running statistics whose
        # updates the ranks combine at the step (strategies/batchnorm/running_stats.py). Written
        # through .data: a graph that saved a buffer (a double backward's) stays valid, as
        # torch's kernels leave it when they update running statistics.
        if self._broadcast_buffers:
            ledger = self.running_stats()
            buffers = [b.data for b in self.module.buffers()
                       if ledger is None or not ledger.holds(b)]
            if buffers:
                fused.fused_broadcast(buffers, src=0)


def prepare_replicated(model: nn.Module, device: torch.device, sync_batchnorm: bool | None
                       ) -> nn.Module:
    """Convert BatchNorm if asked, move to ``device`` and start every rank from rank 0's state."""
    if sync_batchnorm:
        model = convert_sync_batchnorm(model)
    model = model.to(device)
    state = [*model.parameters(), *model.buffers()]
    if state:
        with torch.no_grad():
            fused.fused_broadcast([t.data for t in state], src=0)
    return model


def move_optimizer_state(optimizer: Optimizer) -> None:
    """Put state tensors (e.g. Adam's moments) on their parameter's device."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.device != p.device and value.dim() > 0:
                    optimizer.state[p][key] = value.to(p.device)


def hook_reducer(optimizer: Optimizer, reducer: Reducer) -> None:
    """Sync gradients that ``no_sync`` left local before ``optimizer.step()`` (every other
    backward has synced by its end)."""
    step_chain.building(optimizer).add("sync_grads", reducer.sync)


@register("ddp", "distributed")
class DDPStrategy(Strategy):
    """Distributed data parallel with metadist's own bucketed, overlapping reducer."""

    Config = DDPConfig
    config: DDPConfig

    def _setup_module(self, model: nn.Module) -> ReplicatedModule:
        model = prepare_replicated(model, self.device, self.config.sync_batchnorm)
        trainable = [p for p in model.parameters() if p.requires_grad]
        reducer = None
        if self.world.world_size > 1:
            reducer = Reducer(trainable, scale=self.reduce_factor,
                              bucket_cap_mb=self.config.bucket_cap_mb,
                              first_bucket_mb=self.config.first_bucket_mb,
                              reduce_dtype=self.reduce_dtype)
        return ReplicatedModule(model, reducer, self.config.broadcast_buffers)

    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        move_optimizer_state(optimizer)
        if isinstance(module, ReplicatedModule) and module.reducer is not None:
            hook_reducer(optimizer, module.reducer)
        return optimizer

    @contextmanager
    def no_sync(self, module: DistributedModule) -> Iterator[None]:
        reducer = getattr(module, "reducer", None)
        if reducer is None:
            yield
            return
        previous = reducer.set_sync_enabled(False)
        try:
            yield
        finally:
            reducer.set_sync_enabled(previous)

    def _clip_grad_norm(self, module: DistributedModule, max_norm: float,
                        norm_type: float) -> torch.Tensor:
        reducer = getattr(module, "reducer", None)
        if reducer is not None:
            reducer.sync()
        return super()._clip_grad_norm(module, max_norm, norm_type)
