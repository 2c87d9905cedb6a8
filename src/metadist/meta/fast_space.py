"""The hypergradient functions on fast weights that are shards (``model.fast_weights()``
under zero3/hsdp, passed as ``params``).

The functions' convention for ``grad_sync`` is "each rank differentiates its own loss, and
the products are averaged over ranks". A gradient with respect to shard pieces cannot be one
rank's own: the gathers' backward has already summed the shard group's. So for the inner
parameters theta the average is formed from that sum (:meth:`mean_of_local`: the sum across
hsdp's replica groups, over the world's size), which is what averaging every rank's own
gradient would give; gradients with respect to the hyperparameters (whole tensors) are
partial on each rank and go through ``grad_sync`` as before. Inner products over theta sum
over the shard group, and what a recorded backward saves stays shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import Tensor
from torch.utils._pytree import TreeSpec

from metadist.meta.optim import GradSync
from metadist.strategies.fast_weights import layout_of
from metadist.strategies.shard_piece import shard_internals

__all__ = ["laid_out", "over", "over_theta", "shard_internals", "sharded_now", "sync",
           "sync_split", "sync_theta"]

_DOT: ContextVar[Any] = ContextVar("metadist_fast_dot", default=None)


def _sharded(spec: TreeSpec) -> Any:
    layout = layout_of(spec)
    return layout if layout is not None and layout.sharded else None


@contextmanager
def over(spec: TreeSpec) -> Iterator[None]:
    """Inside: a computation on the inner parameters ``spec`` describes (nothing to do
    unless they are shard fast weights)."""
    layout = _sharded(spec)
    if layout is None:
        yield
        return
    token = _DOT.set(layout)
    try:
        with layout.recording():
            yield
    finally:
        _DOT.reset(token)


def sync(grad_sync: GradSync | None, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``grad_sync`` applied (nothing without one)."""
    return tuple(tensors) if grad_sync is None else tuple(grad_sync(tuple(tensors)))


def sync_theta(grad_sync: GradSync | None, grads: Sequence[Tensor], spec: TreeSpec
               ) -> tuple[Tensor, ...]:
    """Gradients with respect to the inner parameters, averaged over ranks."""
    layout = _sharded(spec)
    return layout.mean_of_local(grads) if layout is not None else sync(grad_sync, grads)


def sync_split(grad_sync: GradSync | None, grads: Sequence[Tensor], n: int, spec: TreeSpec
               ) -> tuple[Tensor, ...]:
    """The first ``n`` with respect to the inner parameters, the rest to hyperparameters."""
    if _sharded(spec) is None:
        return sync(grad_sync, grads)  # one collective for both
    return (*sync_theta(grad_sync, grads[:n], spec), *sync(grad_sync, grads[n:]))


def laid_out(values: Any, spec: TreeSpec) -> Any:
    """Per-parameter ``values`` by name (e.g. SAMA's preconditioner) laid out like the
    inner parameters when they are shard fast weights; as they are otherwise."""
    layout = _sharded(spec)
    if layout is None or not isinstance(values, Mapping):
        return values
    return list(layout.like(values))


def sharded_now() -> bool:
    """Inside :func:`over` on shard fast weights."""
    return _DOT.get() is not None


def over_theta(local: Tensor) -> Tensor:
    """A sum over this rank's elements of inner-parameter vectors, made the sum over all of
    them (inside :func:`over` on shard fast weights: one collective)."""
    layout = _DOT.get()
    return local if layout is None else layout.reduce_sum(local)
