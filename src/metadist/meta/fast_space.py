"""The hypergradient functions on fast weights that are shards (``model.fast_weights()``
under zero3/hsdp, passed as ``params``).

The functions' convention for ``grad_sync`` is "each rank differentiates its own loss, and
the products are averaged over ranks". A gradient with respect to shard pieces cannot be one
rank's own: the gathers' backward has already summed the shard group's. So for the inner
parameters theta the average is formed from that sum (:meth:`mean_of_local`: the sum across
hsdp's replica groups, over the world's size), which is what averaging every rank's own
gradient would give; gradients with respect to the hyperparameters (whole tensors) are
partial on each rank and go through ``grad_sync`` as before, unless the hyperparameters
are shard fast weights themselves (an upper problem's model under zero3/hsdp): then their
gradients are pieces and take the same route as theta's. Every gradient with respect to the
hyperparameters is synced by :func:`sync_lam`, which reads the route from the
:class:`Hparams` the functions hold, so no function can average pieces of different shards.
Inner products over theta sum over the shard group, and what a recorded backward saves
stays shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from metadist.meta.optim import GradSync
from metadist.strategies.fast_weights import FastWeights, layout_of
from metadist.strategies.tensors.shard_piece import shard_internals

__all__ = ["Hparams", "HparamsLike", "hparams_of", "laid_out", "over", "over_theta",
           "shard_internals", "sharded_now", "sync_lam", "sync_split", "sync_theta"]

_DOT: ContextVar[Any] = ContextVar("metadist_fast_dot", default=None)


def _sharded(spec: TreeSpec) -> Any:
    layout = layout_of(spec)
    return layout if layout is not None and layout.sharded else None


#: What the hypergradient functions take as ``hparams``.
HparamsLike = Sequence[Tensor] | Tensor | FastWeights


class Hparams(tuple[Tensor, ...]):
    """The hyperparameters as the hypergradient functions hold them: their tensors (what
    the gradients are taken with respect to), ``layout``, the layout of the shard fast
    weights they are pieces of (None: whole tensors, each rank's gradient its own), and
    ``spec``, the structure the loss functions get them in (:meth:`tree`)."""

    layout: Any
    spec: TreeSpec | None

    def __new__(cls, tensors: Sequence[Tensor], layout: Any = None,
                spec: TreeSpec | None = None) -> Hparams:
        out = super().__new__(cls, tensors)
        out.layout, out.spec = layout, spec
        return out

    def tree(self) -> Any:
        """What the loss functions get: fast weights as fast weights (under every strategy,
        so the same code runs everywhere), anything else as a tuple of tensors."""
        return tuple(self) if self.spec is None else tree_unflatten(list(self), self.spec)


def hparams_of(hparams: HparamsLike) -> Hparams:
    """``hparams`` (a tensor, a sequence of tensors, or fast weights) as :class:`Hparams`,
    checked: the hypergradient is taken with respect to them."""
    if isinstance(hparams, Hparams):
        lam = hparams
    elif isinstance(hparams, FastWeights):
        pieces, spec = tree_flatten(hparams)
        lam = Hparams(pieces, hparams.layout if hparams.layout.sharded else None, spec)
    else:
        lam = Hparams((hparams,) if isinstance(hparams, Tensor) else tuple(hparams))
    if not lam or not all(isinstance(h, Tensor) and h.requires_grad for h in lam):
        raise ValueError("hparams must be a non-empty tuple of tensors (or fast weights) with "
                         "requires_grad=True (e.g. (log_decay,) with "
                         "log_decay.requires_grad_())")
    return lam


@contextmanager
def over(spec: TreeSpec, lam: Hparams | None = None) -> Iterator[None]:
    """Inside: a computation on the inner parameters ``spec`` describes, and on ``lam``
    (nothing to do unless either is shard fast weights: their saved tensors stay shards)."""
    layout = _sharded(spec)
    recording = layout if layout is not None else (lam.layout if lam is not None else None)
    if recording is None:
        yield
        return
    token = _DOT.set(layout)
    try:
        with recording.recording():
            yield
    finally:
        _DOT.reset(token)


def _sync(grad_sync: GradSync | None, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``grad_sync`` applied (nothing without one)."""
    return tuple(tensors) if grad_sync is None else tuple(grad_sync(tuple(tensors)))


def sync_theta(grad_sync: GradSync | None, grads: Sequence[Tensor], spec: TreeSpec
               ) -> tuple[Tensor, ...]:
    """Gradients with respect to the inner parameters, averaged over ranks."""
    layout = _sharded(spec)
    return layout.mean_of_local(grads) if layout is not None else _sync(grad_sync, grads)


def sync_lam(grad_sync: GradSync | None, grads: Sequence[Tensor], lam: Hparams
             ) -> tuple[Tensor, ...]:
    """Gradients with respect to the hyperparameters ``lam`` (any number of sets of them,
    e.g. both sides of a finite difference), averaged over ranks."""
    if lam.layout is not None:
        return tuple(lam.layout.mean_of_local(grads))
    return _sync(grad_sync, grads)


def sync_split(grad_sync: GradSync | None, grads: Sequence[Tensor], n: int, spec: TreeSpec,
               lam: Hparams) -> tuple[Tensor, ...]:
    """The first ``n`` with respect to the inner parameters, the rest to ``lam``."""
    if _sharded(spec) is None and lam.layout is None:
        return _sync(grad_sync, grads)  # one collective for both
    return (*sync_theta(grad_sync, grads[:n], spec), *sync_lam(grad_sync, grads[n:], lam))


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
