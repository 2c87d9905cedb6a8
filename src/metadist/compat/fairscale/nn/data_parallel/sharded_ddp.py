"""FairScale's ``ShardedDataParallel``: the model and its OSS optimizer set up under "zero2".

Each gradient is reduced to the rank that owns its parameter, which alone steps it (ZeRO-2),
and the owners refresh everyone's copy after the step; the numbers are one process's on
the global batch. The wrapped module stays ``model.module``, and state-dict keys carry the
``module.`` prefix, as FairScale's do.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import metadist
from metadist.comm import ops
from metadist.compat.fairscale._options import check_group, refuse
from metadist.compat.fairscale.optim.oss import OSS
from metadist.strategies.module import DistributedModule


class ShardedDataParallel(nn.Module):
    """``ShardedDataParallel(module, sharded_optimizer, process_group=None, ...)``."""

    def __init__(self, module: nn.Module, sharded_optimizer: OSS | Sequence[OSS],
                 process_group: Any = None, broadcast_buffers: bool = True,
                 sync_models_at_startup: bool = True, reduce_buffer_size: int = 2**23,
                 auto_refresh_trainable: bool = True, reduce_fp16: bool = False,
                 warn_on_trainable_params_changed: bool = True) -> None:
        super().__init__()
        check_group(process_group, "ShardedDataParallel")
        optimizers = (list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple))
                      else [sharded_optimizer])
        if len(optimizers) != 1 or not isinstance(optimizers[0], OSS):
            raise TypeError(
                "ShardedDataParallel(module, sharded_optimizer): metadist sets up one OSS "
                f"optimizer per model, got {[type(o).__name__ for o in optimizers]}; put "
                "several parameter sets in one OSS as param groups")
        oss = optimizers[0]
        if oss.is_bound:
            raise ValueError("this OSS optimizer already belongs to a ShardedDataParallel; "
                             "build one OSS per model")
        options: dict[str, Any] = {"broadcast_buffers": broadcast_buffers}
        if reduce_buffer_size > 0:  # FairScale counts elements, metadist megabytes
            first = next(module.parameters(), None)
            size = first.element_size() if first is not None else 4
            options["bucket_cap_mb"] = reduce_buffer_size * size / 2**20
        if reduce_fp16:
            options["reduce_dtype"] = torch.float16
        self.strategy = metadist.strategy("zero2", **options)
        self.module = module
        distributed, _ = self.strategy.setup(module, oss.optim)
        # not a registered child: state-dict keys are "module.<name>", as FairScale's
        self.__dict__["_distributed"] = distributed
        oss._bind(self.strategy, distributed)
        self.sharded_optimizers = [oss]
        self.auto_refresh_trainable = auto_refresh_trainable

    @property
    def distributed(self) -> DistributedModule:
        """The module metadist set up (what runs the forward and reduces the gradients)."""
        return self.__dict__["_distributed"]  # type: ignore[no-any-return]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.distributed(*inputs, **kwargs)

    def refresh_trainable(self) -> None:
        """Nothing to rebuild: the reducer follows ``requires_grad`` at every backward."""

    def reduce(self) -> None:
        refuse("ShardedDataParallel", "reduce()", "(a manual reduce)",
               "the backward reduces the gradients itself; to accumulate, run the micro-batches "
               "but the last inside model.no_sync() and the last one outside it")

    @torch.no_grad()
    def sync_buffers(self, blocking: bool = False) -> None:
        """Broadcast rank 0's buffers (batch-norm statistics, say) to every rank."""
        for buffer in self.module.buffers():
            ops.broadcast(buffer, 0)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.distributed.zero_grad(set_to_none=set_to_none)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside reduces."""
        with self.strategy.no_sync(self.distributed):
            yield

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


__all__ = ["ShardedDataParallel"]
