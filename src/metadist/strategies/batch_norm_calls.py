"""Batch statistics decided where they are computed: every ``F.batch_norm`` call.

A set-up model's BatchNorm layers are checked by hooks (strategies/batch_statistics.py,
strategies/cooperative.py), but a hook is asked only when a layer is called as a module. A
program reaches batch statistics around it: a layer's ``forward`` called directly, or its own
normalisation through ``torch.nn.functional.batch_norm`` (functional MAML learners keep their
BatchNorm weights in a list and call it themselves). Each normalised this rank's slice by the
slice's statistics, silently, whatever ``sync_batchnorm`` said. Every one of those paths, and
torch's BatchNorm layers too, ends in ``F.batch_norm``, so that is where the decision is made:
a call that computes for a model set up on several ranks (its forward is running, or the
call is given one of its parameters or buffers, as from one of its methods or submodules
called by the program) and would normalise by batch statistics

* with ``sync_batchnorm=True``, normalises by the global batch's
  (:func:`~metadist.strategies.sync_batchnorm.global_batch_norm`, weighted by this rank's
  share of a ragged batch): one process's result;
* with ``sync_batchnorm=False``, runs as it is, on this rank's batch, as the user said;
* unsaid, stops and asks, as the layers' hook does;

and inside a cooperative inner problem (``model.fast_weights()``) normalises by its group's
batch, or stops where the strategy was not set up with ``sync_batchnorm=True``.

Left alone, as by the hooks: a per-rank-task computation (``functional_forward``, ``bound``,
a copy of the model) and evaluation with running statistics; metadist's own layers, which
decide themselves; code being traced by ``torch.compile`` (the check runs in eager forwards).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from metadist.strategies.batch_statistics import ask
from metadist.strategies.bind import explicit_parameters_active
from metadist.strategies.cooperative import cooperation

_ORIGINAL: dict[str, Callable[..., Tensor]] = {}
_OWN: ContextVar[bool] = ContextVar("metadist_own_batch_norm", default=False)


@dataclass(frozen=True)
class _Forward:
    """A set-up model's forward on several ranks, running now."""

    root: weakref.ref[nn.Module]
    said: bool | None
    strategy: str
    parts: int
    share: weakref.WeakMethod[Callable[[], float]]  # the strategy's batch_share

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


@contextmanager
def own_call() -> Iterator[None]:
    """Within: metadist's own layers call ``F.batch_norm`` (they decided already)."""
    token = _OWN.set(True)
    try:
        yield
    finally:
        _OWN.reset(token)


def watch(root: nn.Module, said: bool | None, strategy: str, parts: int,
          share: Callable[[], float]) -> None:
    """Decide the batch statistics of every ``F.batch_norm`` call in ``root``'s forwards
    (``root`` set up by ``strategy``, its batch split in ``parts``; ``share``: the
    strategy's bound ``batch_share``, held weakly)."""
    _install()
    for handle in _HANDLES.pop(root, ()):
        handle.remove()
    if parts < 2:
        return
    forward = _Forward(weakref.ref(root), said, strategy, parts, weakref.WeakMethod(share))
    for key in [k for k, (ref, _) in _TENSORS.items() if ref() is None]:
        del _TENSORS[key]  # freed since an earlier setup
    for t in [*root.parameters(), *root.buffers()]:
        _TENSORS[id(t)] = (weakref.ref(t), forward)
    local = threading.local()  # dp runs its replicas' forwards in threads of their own

    def ours(module: nn.Module) -> bool:
        # A copy of the model (module_clone, copy.deepcopy) copies these hooks too, but a
        # copy is a plain module each rank runs on its own task; dp's replicas are the model.
        return not torch.compiler.is_compiling() and (
            module is forward.root() or getattr(module, "_is_replica", False))

    def enter(module: nn.Module, args: Any) -> None:
        if ours(module):
            tokens: list[Token[_Forward | None]] = local.__dict__.setdefault("tokens", [])
            tokens.append(_RUNNING.set(forward))

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        tokens = local.__dict__.get("tokens")
        if ours(module) and tokens:
            _RUNNING.reset(tokens.pop())

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
    batch_stats = training or (running_mean is None and running_var is None)
    if not batch_stats or torch.compiler.is_compiling() or _OWN.get():
        return original(*args)
    from metadist.strategies.sync_batchnorm import global_batch_norm

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
            return global_batch_norm(input, running_mean, running_var, weight, bias, factor,
                                     eps, group, 1.0)
        return original(*args)
    forward = _model_of(running_mean, running_var, weight, bias)
    root = None if forward is None else forward.root()
    if forward is None or root is None or explicit_parameters_active(root):
        return original(*args)  # not a set-up model's computation, or a per-rank task's
    if forward.said is False:
        return original(*args)
    if forward.said is True:
        return global_batch_norm(input, running_mean, running_var, weight, bias, factor, eps,
                                 None, forward.share_now())
    raise RuntimeError(ask("F.batch_norm (a BatchNorm reached by a call of its forward, or a "
                           "normalisation of your own)", forward.strategy, forward.parts))


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
