"""Batch statistics decided where they are computed: every ``F.batch_norm`` call.

Every path to batch statistics, torch's BatchNorm layers, a layer's ``forward`` called
directly, a normalisation of the program's own (functional MAML learners keep their BatchNorm
weights in a list), ends in ``F.batch_norm``, so that is where the decision is made for a
call that computes for a model set up on several ranks (its forward is running, a copy of it
is, or the call is given one of its parameters or buffers, as from a method or submodule the
program calls) and would normalise by batch statistics:

* a **per-rank task**, a computation on this rank's own task: a copy of the set-up model
  (learn2learn's clones, higher's patched module, ``module_clone``, ``copy.deepcopy``),
  given parameters (``functional_forward``), or weights other than the model's own (fast
  weights passed to its forward or to ``F.batch_norm``, ``torch.func`` on adapted weights;
  under the replicated strategies, whose parameters are stable tensors), normalises
  by its own batch's statistics whatever ``sync_batchnorm`` says, as one process normalises
  each task's batch;
* the model's own forward on its own parameters (or on the tensors ``bound()`` holds in
  their place: the meta engine's problems) runs on this rank's part of what may be one
  global batch, and ``sync_batchnorm`` says which: ``True`` the statistics of every rank's
  batch together (:func:`~metadist.strategies.batchnorm.sync.global_batch_norm`, weighted by
  this rank's share of a ragged batch); ``False`` each rank's batch by itself, a batch of its
  own (a task, or a micro-batch); unsaid, it stops and asks;
* inside a cooperative inner problem (``model.fast_weights()``) the group's batch, or an
  error where the strategy was not set up with ``sync_batchnorm=True``.

A rank's own batch updates the running statistics as one process running the ranks' batches
in rank order would (strategies/batchnorm/running_stats.py): recorded now, combined at the step.
Left alone: evaluation with running statistics (checked only for updates not yet combined);
metadist's own layers, which decide themselves; code being traced by ``torch.compile``.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from metadist.strategies.batchnorm.running_stats import LEDGERS, RunningStats
from metadist.strategies.batchnorm.statistics import ask
from metadist.strategies.bind import explicit_parameters_active, task_active
from metadist.strategies.cooperative import cooperation

_ORIGINAL: dict[str, Callable[..., Tensor]] = {}
_OWN: ContextVar[bool] = ContextVar("metadist_own_batch_norm", default=False)
#: a copy of a set-up model runs (a per-rank task's)
_COPY: ContextVar[bool] = ContextVar("metadist_copy_running", default=False)


@dataclass(frozen=True)
class _Forward:
    """A set-up model's forward on several ranks, running now."""

    root: weakref.ref[nn.Module]
    said: bool | None
    strategy: str
    parts: int
    share: weakref.WeakMethod[Callable[[], float]]  # the strategy's batch_share
    ledger: RunningStats
    #: the model's parameters are the tensors its layers compute with (the replicated
    #: strategies); zero3/hsdp bind gathered views instead, and refuse foreign weights
    stable: bool

    def share_now(self) -> float:
        share = self.share()
        return 1.0 if share is None else share()


_RUNNING: ContextVar[_Forward | None] = ContextVar("metadist_data_parallel_forward",
                                                   default=None)
#: the watched models' parameters and buffers, by id: a call given one of them is the
#: model's, also outside its forward (a module method, a submodule called by the program)
_TENSORS: dict[int, tuple[weakref.ref[Tensor], _Forward]] = {}
#: each watched root's hooks, removed by a later setup of the same module
_HANDLES: weakref.WeakKeyDictionary[nn.Module, tuple[RemovableHandle, RemovableHandle]] = \
    weakref.WeakKeyDictionary()


def copy_running() -> AbstractContextManager[None]:
    """Within: a copy of a set-up model runs its forward (a per-rank task)."""
    return _holding(_COPY)


def own_call() -> AbstractContextManager[None]:
    """Within: metadist's own layers call ``F.batch_norm`` (they decided already)."""
    return _holding(_OWN)


@contextmanager
def _holding(flag: ContextVar[bool]) -> Iterator[None]:
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def watch(root: nn.Module, said: bool | None, strategy: str, parts: int,
          share: Callable[[], float], combine: bool = True) -> None:
    """Decide the batch statistics of every ``F.batch_norm`` call in ``root``'s forwards
    (``root`` set up by ``strategy``, its batch split in ``parts``; ``share``: the
    strategy's bound ``batch_share``, held weakly; ``combine``: the parts are ranks, whose
    own batches' running-statistics updates are combined at the step)."""
    _install()
    for handle in _HANDLES.pop(root, ()):
        handle.remove()
    LEDGERS.pop(root, None)
    if parts < 2:
        return
    ledger = RunningStats(root if combine else None)
    LEDGERS[root] = ledger
    if combine:  # under torch.compile the decision below must run: these run eagerly
        for m in root.modules():
            if isinstance(m, _BatchNorm) and not getattr(m, "group_aware", False):
                object.__setattr__(m, "compile_eagerly", True)
    stable = not any(p.is_meta for p in root.parameters())
    forward = _Forward(weakref.ref(root), said, strategy, parts, weakref.WeakMethod(share),
                       ledger, stable)
    for key in [k for k, (ref, _) in _TENSORS.items() if ref() is None]:
        del _TENSORS[key]  # freed since an earlier setup
    for t in [*root.parameters(), *root.buffers()]:
        _TENSORS[id(t)] = (weakref.ref(t), forward)
    local = threading.local()  # dp runs its replicas' forwards in threads of their own

    # A copy of the model (learn2learn's clones, module_clone, copy.deepcopy) copies these
    # hooks too: a copy runs a per-rank task. dp's replicas are the model.
    def enter(module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        tokens: list[Token[Any]] = local.__dict__.setdefault("tokens", [])
        if module is forward.root() or getattr(module, "_is_replica", False):
            tokens.append(_RUNNING.set(forward))
        else:
            tokens.append(_COPY.set(True))

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        tokens = local.__dict__.get("tokens")
        if not torch.compiler.is_compiling() and tokens:
            token = tokens.pop()
            (_RUNNING if token.var is _RUNNING else _COPY).reset(token)

    _HANDLES[root] = (root.register_forward_pre_hook(enter),
                      root.register_forward_hook(leave, always_call=True))


def _install() -> None:
    if _ORIGINAL:
        return
    _ORIGINAL["batch_norm"] = F.batch_norm
    F.batch_norm = functools.wraps(F.batch_norm)(batch_norm)


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.batch_norm``, with the batch statistics decided (module
    notes)."""
    original = _ORIGINAL["batch_norm"]
    args = (input, running_mean, running_var, weight, bias, training, momentum, eps)
    if torch.compiler.is_compiling() or _OWN.get():
        return original(*args)
    if not (training or (running_mean is None and running_var is None)):
        owner = _owner_of(running_mean)  # evaluation: reads the running statistics
        if owner is not None:
            owner.ledger.check_read(running_mean, running_var)
        return original(*args)
    from metadist.strategies.batchnorm.sync import global_batch_norm

    factor = momentum if training and running_mean is not None else None
    cooperative = cooperation()
    if cooperative is not None:
        group, size, replicas = cooperative
        if replicas > 1 and factor is not None:
            raise RuntimeError(
                "F.batch_norm updates running statistics in a cooperative inner problem "
                f"while {replicas} groups of ranks work on different tasks at once (hsdp): "
                "each group's copy would differ from one process's, which updates them task "
                "after task. Pass running_mean=None, running_var=None (batch statistics "
                "only), or run under zero3")
        forward = _model_of(running_mean, running_var, weight, bias)
        if size > 1 and (forward is None or forward.said is not True):
            raise RuntimeError(
                f"F.batch_norm in a cooperative inner problem (model.fast_weights(), its "
                f"batch split over {size} ranks) would normalise this rank's slice by the "
                "slice's statistics, where one process normalises the whole batch. Set the "
                "strategy up with sync_batchnorm=True (statistics over the ranks that share "
                "the problem, exact)")
        if size > 1:
            if forward is not None:
                forward.ledger.global_update(running_mean, running_var)
            return global_batch_norm(input, running_mean, running_var, weight, bias, factor,
                                     eps, group, 1.0)
        return original(*args)
    forward = _model_of(running_mean, running_var, weight, bias)
    root = None if forward is None else forward.root()
    if forward is None or root is None:
        return original(*args)  # not a set-up model's computation
    if forward.said is False or per_rank_task(forward, root, weight, bias):
        if factor is not None and forward.ledger and not forward.ledger.updates(
                running_mean, running_var) and _owner_of(running_mean) is forward:
            raise RuntimeError(_unpaired(root, running_mean))
        return own_batch(forward.ledger, running_mean, running_var, factor,
                         lambda mean, var, m: original(input, mean, var, weight, bias, True, m,
                                                       eps), lambda: original(*args))
    if forward.said is True:
        forward.ledger.global_update(running_mean, running_var)
        return global_batch_norm(input, running_mean, running_var, weight, bias, factor, eps,
                                 None, forward.share_now())
    raise RuntimeError(ask("F.batch_norm (a BatchNorm reached by a call of its forward, or a "
                           "normalisation of your own)", forward.strategy, forward.parts))


def per_rank_task(forward: _Forward, root: nn.Module, weight: Tensor | None,
                  bias: Tensor | None) -> bool:
    """Whether a normalisation for ``root``'s model computes a per-rank task (module
    notes): a copy of it runs, ``functional_forward`` runs it on given parameters, or the
    weights given are not the model's own (outside ``bound()``, where the model holds other
    tensors as its own: the meta engine's problems, decided as the model's forward)."""
    if _COPY.get() or task_active(root):
        return True
    if explicit_parameters_active(root):  # bound(): the model itself, on other tensors
        return False
    given = [t for t in (weight, bias) if t is not None]
    return forward.stable and bool(given) and not any(_is_model_tensor(t, forward)
                                                      for t in given)


def task_ledger(running_mean: Tensor | None, running_var: Tensor | None,
                weight: Tensor | None, bias: Tensor | None) -> RunningStats | None:
    """For a layer that decides itself (SyncBatchNorm): the running-statistics record of
    the set-up model its normalisation computes a per-rank task for (an empty one for a copy
    whose tensors are all its own), else None: not a per-rank task."""
    forward = _model_of(running_mean, running_var, weight, bias)
    root = None if forward is None else forward.root()
    if forward is None or root is None:
        return RunningStats(None) if _COPY.get() else None
    return forward.ledger if per_rank_task(forward, root, weight, bias) else None


def own_batch(ledger: RunningStats, running_mean: Tensor | None, running_var: Tensor | None,
              factor: float | None, normalise: Callable[[Tensor | None, Tensor | None, float],
                                                        Tensor],
              as_written: Callable[[], Tensor]) -> Tensor:
    """A normalisation of this rank's batch by its own statistics, ``normalise(mean, var,
    momentum)`` (``F.batch_norm`` in training mode on those running statistics), leaving the
    model's running statistics as they are: it runs on two fresh vectors with momentum 1,
    which torch's kernel fills with the batch's mean and unbiased variance in the same pass,
    and the update they make is recorded for the step (strategies/batchnorm/running_stats.py).
    ``as_written()``: the call as written, for running statistics that are not the model's."""
    if factor is None:
        return normalise(None, None, 0.0)
    if running_mean is None or running_var is None \
            or not ledger.updates(running_mean, running_var):
        return as_written()  # the program's own tensors, not the model's
    mean, var = torch.zeros_like(running_mean), torch.ones_like(running_var)
    out = normalise(mean, var, 1.0)
    ledger.record(running_mean, running_var, mean, var, factor)
    return out


def _unpaired(root: nn.Module, running_mean: Tensor | None) -> str:
    name = next((n for n, t in [*root.named_buffers(), *root.named_parameters()]
                 if t is running_mean), "a tensor")
    return (f"F.batch_norm updates '{name}' of the set-up model as running statistics from "
            "this rank's own batch together with a tensor that is not a floating buffer of "
            "the model, so the updates cannot be combined across ranks as one process makes "
            "them. Register both running statistics as buffers of the model, or pass "
            "running_mean=None, running_var=None")


def _is_model_tensor(t: Tensor, forward: _Forward) -> bool:
    entry = _TENSORS.get(id(t))
    return entry is not None and entry[0]() is t and entry[1] is forward


def _owner_of(running_mean: Tensor | None) -> _Forward | None:
    entry = None if running_mean is None else _TENSORS.get(id(running_mean))
    return entry[1] if entry is not None and entry[0]() is running_mean else None


def ledger_of(running_mean: Tensor | None) -> RunningStats | None:
    """The running-statistics record of the set-up model that holds ``running_mean``."""
    owner = _owner_of(running_mean)
    return None if owner is None else owner.ledger


def _model_of(*tensors: Tensor | None) -> _Forward | None:
    """The set-up model this call computes for: the one whose forward runs, else the one
    that holds one of ``tensors``."""
    running = _RUNNING.get()
    if running is not None:
        return running
    for t in tensors:
        entry = None if t is None else _TENSORS.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
    return None
