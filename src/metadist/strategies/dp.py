"""``"dp"``: one process driving several GPUs (replicate, scatter, parallel_apply, gather).

Gradients of the replicas flow back to the original parameters through the differentiable
broadcast inside ``replicate``, so the optimizer sees one set of summed gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate
from torch.nn.parallel.scatter_gather import scatter_kwargs
from torch.optim import Optimizer

from metadist.strategies.base import Strategy
from metadist.strategies.batchnorm.statistics import plain_batchnorms
from metadist.strategies.ddp import move_optimizer_state
from metadist.strategies.module import DistributedModule
from metadist.strategies.registry import register


class DataParallelModule(DistributedModule):
    """Splits each batch along dim 0 over ``device_ids`` and gathers outputs on the first."""

    def __init__(self, module: nn.Module, device_ids: list[int]) -> None:
        super().__init__(module)
        self.device_ids = device_ids

    def _check_devices(self, args: tuple[Any, ...]) -> None:
        pass  # scatter moves CPU batches to the GPUs itself

    def compile_pieces(self) -> list[nn.Module]:
        # replicate() copies the module each forward and runs the copies in threads, where
        # a compiled forward would still be bound to the original module's parameters.
        raise RuntimeError(
            "torch.compile of a model set up by strategy 'dp' is not supported (DataParallel "
            "replicates the module in threads each step); use metadist.strategy('ddp'), one "
            "process per GPU, and compile as before")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self._scatter_apply, args, kwargs)

    def _scatter_apply(self, *args: Any, **kwargs: Any) -> Any:
        inputs, kw = scatter_kwargs(args, kwargs, self.device_ids, dim=0)
        if not inputs:  # nothing to split (no tensor arguments): run on the first device
            return self.module(*args, **kwargs)
        used = self.device_ids[:len(inputs)]
        replicas = replicate(self.module, used)
        outputs = parallel_apply(replicas, inputs, kw, used)
        return gather(outputs, used[0], dim=0)


@register("dp")
class DataParallelStrategy(Strategy):
    """Single-process multi-GPU data parallelism; use ``"ddp"`` on CPUs or one GPU."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def _device_ids(self) -> list[int]:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            raise ValueError(
                f"strategy 'dp' drives several GPUs from one process but {count} GPU(s) are "
                "visible; use metadist.strategy('ddp') (one process per device, CPU included)")
        return list(range(count))

    def _setup_module(self, model: nn.Module) -> DistributedModule:
        if self.config.sync_batchnorm and plain_batchnorms(model):
            # before: accepted and ignored, each replica normalising its chunk alone
            raise ValueError(
                "strategy 'dp' runs its replicas in threads of one process, where BatchNorm "
                "statistics cannot be reduced across them, so sync_batchnorm=True cannot be "
                "honoured. Use metadist.strategy('ddp', sync_batchnorm=True) (one process per "
                "GPU) for the global batch's statistics, or sync_batchnorm=False to normalise "
                "each replica's chunk alone")
        ids = self._device_ids()
        return DataParallelModule(model.to(torch.device("cuda", ids[0])), ids)

    def _batch_parts(self, module: DistributedModule) -> int:
        assert isinstance(module, DataParallelModule)
        return len(module.device_ids)  # each replica normalises its chunk of the batch

    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        move_optimizer_state(optimizer)
        return optimizer
