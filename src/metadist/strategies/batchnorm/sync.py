"""Cross-rank BatchNorm on CPU and GPU, built on the differentiable all-reduce.

Batch statistics are the global batch's: each rank contributes per-channel sums, sums of
squares and counts (in float64, one collective per layer per forward). Because the
all-reduce is differentiable with the ``per_rank`` convention, autograd produces the exact
gradients of the global objective, double backward included, with no hand-written backward.
Running statistics are updated from the global mean and unbiased variance, so every rank's
buffers stay identical without a broadcast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from metadist.comm import functional, ops
from metadist.runtime.world import Group
from metadist.strategies.batchnorm.calls import ledger_of, own_batch, own_call, task_ledger
from metadist.strategies.batchnorm.statistics import share_of
from metadist.strategies.cooperative import cooperating_group, cooperation, uses_batch_statistics


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is scaled by ``factor`` (differentiably: double
    backward too)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the batch of every rank in ``group`` (any input with channels in dim 1).

    Where a set-up model's ranks hold uneven shares of the global batch (a ragged last
    batch), each rank's gradient is weighted by its share after the backward, while the
    gradient its loss sends through the global statistics reaches every rank's samples. So
    each rank's contribution to that exchange is weighted by its share relative to an even
    split on the way in (and divided by it on the way back to its own samples, where the
    strategy's weight then applies): the sum is the global objective's. A stand-in sample
    (share 0) adds nothing to the statistics."""

    #: torch.compile runs it eagerly (strategies/compile.py): Dynamo must not trace its
    #: collective, whose graph would replay one step's sizes and group.
    compile_eagerly = True
    #: in a cooperative inner problem its statistics are that problem's group's
    #: (strategies/cooperative.py)
    group_aware = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 group: Group = None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input, got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        active = cooperating_group()
        group = self.group if active is None else active
        if not uses_batch_statistics(self) or ops.group_info(group)[1] == 1:
            return self._local(x)
        factor = None
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        running = (self.running_mean, self.running_var)
        if cooperation() is None:
            # a per-rank task (a copy of the set-up model, explicit or adapted weights):
            # this task's batch alone, as one process normalises each task's
            task = task_ledger(*running, self.weight, self.bias)
            if task is not None:
                with own_call():
                    return own_batch(task, *running, factor, lambda mean, var, m: F.batch_norm(
                        x, mean, var, self.weight, self.bias, True, m, self.eps),
                        lambda: F.batch_norm(x, *running, self.weight, self.bias, True,
                                             factor or 0.0, self.eps))
        ledger = ledger_of(self.running_mean)
        if ledger is not None and factor is not None:
            ledger.global_update(*running)
        share = share_of(self) if active is None and self.group is None else 1.0
        return global_batch_norm(x, self.running_mean, self.running_var, self.weight,
                                 self.bias, factor, self.eps, group, share)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """Plain BatchNorm (one rank, or evaluation with running statistics)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        with own_call():
            return F.batch_norm(
                x,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, use_batch_stats, factor, self.eps)


def global_batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None,
                      running_var: torch.Tensor | None, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, factor: float | None, eps: float,
                      group: Group, share: float) -> torch.Tensor:
    """``x`` (channels in dim 1) normalised by the statistics of every rank's batch in
    ``group``: per-channel sums, sums of squares and counts in float64, one differentiable
    all-reduce. ``factor``: the running statistics' update weight (None: not updated);
    ``share``: this rank's share of the global batch relative to an even split (see
    :class:`SyncBatchNorm`)."""
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    local = torch.cat([
        x.sum(dims, dtype=torch.float64),
        x.square().sum(dims, dtype=torch.float64),
        x.new_full((1,), x.numel() // channels, dtype=torch.float64),
    ])
    if share != 1.0:  # an uneven split of the global batch (see the class notes)
        local = local * 0.0 if share == 0.0 else _ScaleGrad.apply(local, 1.0 / share)
    total = functional.all_reduce(local, "sum", group=group)
    if share != 1.0:
        total = _ScaleGrad.apply(total, share)
    count = total[-1]
    mean64 = total[:channels] / count
    var64 = total[channels:2 * channels] / count - mean64.square()
    if factor is not None and running_mean is not None and running_var is not None:
        _update_running_stats(running_mean, running_var, mean64.detach(), var64.detach(),
                              count.detach(), factor)
    shape = [1, channels] + [1] * (x.dim() - 2)
    mean = mean64.to(x.dtype).view(shape)
    inv_std = torch.rsqrt(var64 + eps).to(x.dtype).view(shape)
    y = (x - mean) * inv_std
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


@torch.no_grad()
def _update_running_stats(running_mean: torch.Tensor, running_var: torch.Tensor,
                          mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor,
                          factor: float) -> None:
    # through .data: autograd does not version an update of running statistics (torch's
    # kernels make theirs likewise), so a graph that saved them, a double backward's, stays
    # valid
    unbiased = var * (count / (count - 1.0).clamp(min=1.0))
    running_mean.data.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
    running_var.data.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, group: Group = None) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by :class:`SyncBatchNorm`, keeping the same
    parameter and buffer tensors (optimizers built on them stay valid). Returns the module
    (a new one only when ``module`` itself is a BatchNorm layer)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, group=group)
        if module.affine:
            sync.weight, sync.bias = module.weight, module.bias
        sync.running_mean = module.running_mean
        sync.running_var = module.running_var
        sync.num_batches_tracked = module.num_batches_tracked
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, group)
        if converted is not child:
            setattr(module, name, converted)
    return module
