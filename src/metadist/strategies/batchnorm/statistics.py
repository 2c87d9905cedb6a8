"""A BatchNorm on several ranks: whose statistics it normalises by is said, never assumed.

Under a data-parallel strategy a rank's forward sees its own batch: a slice of one global
batch, or a batch of its own (a task, in meta-learning). Only the program knows which, and
one process normalises the two differently. Which statistics the model's own forward uses
is the strategy's ``sync_batchnorm``:

* ``True``: BatchNorm layers become :class:`~metadist.strategies.batchnorm.sync.SyncBatchNorm`,
  statistics over every rank's batch together: one process's result where the ranks'
  batches are slices of one global batch;
* ``False``: each rank's batch by itself, and the running statistics as one process running
  the ranks' batches one after another (strategies/batchnorm/running_stats.py): one process's result
  where each rank's batch is a batch of its own (a task, or a micro-batch);
* unsaid (``None``, the default): the first forward on more than one rank that would
  normalise by batch statistics stops, says what differs and asks for one of the two.

Not asked, because the answer changes nothing: a per-rank task (a copy of the model,
explicit parameters, adapted weights: strategies/batchnorm/calls.py), which normalises by
its own task's batch whatever is said, and a cooperative inner problem (``fast_weights()``),
which strategies/cooperative.py checks by its own rule. The check is a forward pre-hook on
the plain BatchNorm layers of a model set up on several ranks with the choice unsaid (the
same question is asked at ``F.batch_norm`` for every other path); nothing else pays for it.

A ragged global batch is split unevenly (metadist/data.py): each rank's gradient is weighted
by its share, and a rank left without samples runs one stand-in sample of weight 0. A
synchronised BatchNorm's statistics are the global batch's whatever the split, but the
gradient a rank's loss sends through them to the other ranks' samples must carry that
rank's share too, and a stand-in's sample must not count in them at all. So the
synchronised layers of a set-up model read their strategy's share of this rank's batch
(:func:`share_of`; see strategies/batchnorm/sync.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from metadist.strategies.bind import explicit_parameters_active
from metadist.strategies.cooperative import cooperation, uses_batch_statistics

#: each checked layer's hook, removed by a later setup of the same module
_HANDLES: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()
#: each synchronised layer's strategy's share of this rank's batch (Strategy.batch_share)
_SHARES: weakref.WeakKeyDictionary[nn.Module, weakref.WeakMethod[Callable[[], float]]] = \
    weakref.WeakKeyDictionary()


def weigh_by(model: nn.Module, batch_share: Callable[[], float]) -> None:
    """The synchronised BatchNorm layers of ``model`` weigh this rank's batch by
    ``batch_share()`` (a strategy's bound method, held weakly)."""
    for m in model.modules():
        if getattr(m, "group_aware", False):
            _SHARES[m] = weakref.WeakMethod(batch_share)


def share_of(layer: nn.Module) -> float:
    """This rank's share of the global batch through ``layer``, relative to an even split
    (exactly 1.0 for an even one, 0 for a stand-in): its set-up strategy's, else 1."""
    ref = _SHARES.get(layer)
    share = None if ref is None else ref()
    return 1.0 if share is None else share()


def plain_batchnorms(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The BatchNorm layers of ``model`` that normalise by their own rank's batch alone."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
            and not getattr(m, "group_aware", False)]


def ask_for_the_choice(model: nn.Module, said: bool | None, strategy: str,
                       world_size: int) -> None:
    """Check the plain BatchNorm layers of ``model`` (set up by ``strategy`` on
    ``world_size`` ranks) when ``sync_batchnorm`` was left unsaid; a setup that says it
    removes an earlier setup's check."""
    root = weakref.ref(model)
    for name, layer in plain_batchnorms(model):
        handle = _HANDLES.pop(layer, None)
        if handle is not None:
            handle.remove()
        if said is None and world_size > 1:
            _HANDLES[layer] = layer.register_forward_pre_hook(
                _Check(root, layer, name or type(model).__name__, strategy, world_size))


class _Check:
    """The pre-hook of one layer (holds the model and the layer weakly: the layer is inside
    the model). A copy of the model (``module_clone``, ``copy.deepcopy``, learn2learn's
    clones) copies the hook too, but a copy is a plain module each rank runs on its own,
    the per-rank-task path: the hook checks only the layer it was installed on, and the
    replicas ``dp`` makes of it for each step (torch marks them ``_is_replica``)."""

    def __init__(self, root: weakref.ref[nn.Module], layer: nn.Module, name: str,
                 strategy: str, world_size: int) -> None:
        self.root, self.layer = root, weakref.ref(layer)
        self.name, self.strategy, self.world_size = name, strategy, world_size
        #: the layer's own weights (weights swapped in, e.g. by torch.func, are a task's);
        #: none where a sharding strategy binds gathered copies for each forward
        weights = [t for t in (layer.weight, layer.bias) if t is not None]
        self.own = None if any(t.is_meta for t in weights) else {id(t) for t in weights}

    def __call__(self, layer: _BatchNorm, args: Any) -> None:
        installed = layer is self.layer() or getattr(layer, "_is_replica", False)
        if not installed or not uses_batch_statistics(layer) or cooperation() is not None:
            return
        root = self.root()
        if root is not None and explicit_parameters_active(root):
            return  # a per-rank-task computation: the batch is this rank's own task
        weights = [t for t in (getattr(layer, "weight", None), getattr(layer, "bias", None))
                   if t is not None]
        if weights and self.own is not None and not getattr(layer, "_is_replica", False) \
                and not any(id(t) in self.own for t in weights):
            return  # adapted weights: a per-rank task's
        raise RuntimeError(ask(f"BatchNorm layer '{self.name}' ({type(layer).__name__})",
                               self.strategy, self.world_size))


def ask(subject: str, strategy: str, parts: int) -> str:
    """What ``subject``, normalising by batch statistics under ``strategy`` (the batch in
    ``parts``) with ``sync_batchnorm`` unsaid, would compute, and the two choices."""
    # 'dp' splits the batch over replicas in one process, which cannot share statistics
    part, synced = ("replica", "ddp") if strategy == "dp" else ("rank", strategy)
    return (f"{subject} would normalise by batch statistics on {parts} {part}s under "
            f"'{strategy}', where each {part} holds its own batch, and only your program "
            "knows whether the batches are slices of one global batch or batches of their "
            "own. Say which: metadist.strategy("
            f"'{synced}', sync_batchnorm=True) if they are slices of one global batch (the "
            f"statistics of every {part}'s batch together: one process's result on the "
            f"global batch), or sync_batchnorm=False if each {part}'s batch is one of its own, "
            "a task as in meta-learning or a micro-batch (each normalised alone, running "
            "statistics updated batch after batch in rank order: one process's result "
            "running them one after another). A copy of the model or adapted weights (a "
            "per-rank task) normalise by their own batch either way")
