"""The group of ranks a computation on fast weights cooperates in, for the layers that need it.

A cooperative inner problem (``model.fast_weights()``) is one problem whose batch the ranks of
a group split. A layer whose output depends on the whole batch, not on each sample alone,
must therefore see the group's batch: BatchNorm's statistics. While such a computation runs,
:func:`cooperating` holds its group, and

* metadist's :class:`~metadist.strategies.batchnorm.sync.SyncBatchNorm` reduces its
  statistics over that group (under ``hsdp`` the node's ranks, which share a task, not the
  world, which works on several);
* a plain BatchNorm layer that would normalise with batch statistics stops the forward
  before it computes: it would normalise each rank's slice by the slice's statistics,
  which is not what one process computes on the whole batch. The error says to set the
  strategy up with ``sync_batchnorm=True``;
* under ``hsdp``, whose replica groups work on different tasks at once, any BatchNorm that
  would update its running statistics stops too: one process updates them task after
  task, and each group's copy would differ (``track_running_stats=False``, as MAML
  usually has it, or ``zero3`` are exact).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from metadist.runtime.world import Group

#: (group, its size, groups working on other tasks at once) of the cooperative computation
#: running; None outside one
_GROUP: ContextVar[tuple[Group, int, int] | None] = ContextVar("metadist_cooperating",
                                                              default=None)
_HOOK: list[RemovableHandle] = []  # the global pre-hook, while any computation needs it
_OPEN = [0]


def cooperation() -> tuple[Group, int, int] | None:
    """(group, its size, groups working on other tasks at once) of the cooperative
    computation running now; None outside one."""
    return _GROUP.get()


def cooperating_group() -> Group | None:
    """The group the computation running now shares one inner problem in (None: the
    default group, or no such computation runs)."""
    active = _GROUP.get()
    return None if active is None else active[0]


@contextmanager
def cooperating(group: Group, size: int, replicas: int = 1) -> Iterator[None]:
    """Within: forwards serve one inner problem whose batch ``group``'s ``size`` ranks
    split, while ``replicas`` such groups work on other problems at once. Nested
    computations keep the innermost group."""
    token = _GROUP.set((group, size, replicas))
    needs_hook = size > 1 or replicas > 1
    if needs_hook:
        _OPEN[0] += 1
        if not _HOOK:
            _HOOK.append(nn.modules.module.register_module_forward_pre_hook(_check_layer))
    try:
        yield
    finally:
        _GROUP.reset(token)
        if needs_hook:
            _OPEN[0] -= 1
            if _OPEN[0] == 0 and _HOOK:
                _HOOK.pop().remove()


def uses_batch_statistics(layer: _BatchNorm) -> bool:
    return layer.training or (layer.running_mean is None and layer.running_var is None)


def _check_layer(module: nn.Module, args: Any) -> None:
    active = _GROUP.get()
    if not isinstance(module, _BatchNorm) or active is None:
        return
    _, size, replicas = active
    if replicas > 1 and module.training and module.track_running_stats:
        raise RuntimeError(
            f"{type(module).__name__}({module.num_features}) updates its running statistics "
            f"in a cooperative inner problem while {replicas} groups of ranks work on "
            "different tasks at once (hsdp): one process updates them task after task, so "
            "each group's copy would differ. Build the layer with track_running_stats=False "
            "(batch statistics only, as MAML usually has it), or run under zero3 (one group, "
            "the tasks one after another)")
    if size == 1 or getattr(module, "group_aware", False) or not uses_batch_statistics(module):
        return
    raise RuntimeError(
        f"{type(module).__name__}({module.num_features}) in a cooperative inner problem "
        f"(model.fast_weights(), its batch split over {size} ranks) would normalise "
        "this rank's slice with the slice's own statistics, where one process normalises "
        "the whole batch. Set the strategy up with sync_batchnorm=True (statistics over the "
        "ranks that share the problem, exact), or use a layer without batch statistics "
        "(GroupNorm, LayerNorm, or this layer in eval mode)")


class Resumed:
    """The cooperative computation running at construction, re-entered around a
    recomputation in backward (activation checkpointing), where the forward's block has
    long exited: the recomputed layers must reduce over the group the forward did.
    Re-enterable (a graph may be recomputed more than once)."""

    def __init__(self) -> None:
        self.active = _GROUP.get()
        self._tokens: list[Token[tuple[Group, int, int] | None]] = []

    def __enter__(self) -> None:
        self._tokens.append(_GROUP.set(self.active))

    def __exit__(self, *exc: object) -> None:
        _GROUP.reset(self._tokens.pop())
