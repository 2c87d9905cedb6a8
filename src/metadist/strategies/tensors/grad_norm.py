"""torch's gradient utilities on gradients that are split across ranks.

Under zero3/hsdp a rank holds a slice of every parameter and of its gradient, and under
zero2 a gradient is kept only by the rank that owns its parameter: a norm of the gradients one rank
holds is that rank's part of the norm one process computes. Once such a model is set up,
metadist makes torch's utilities say so or compute the global value:

* ``torch.nn.utils.get_total_norm`` over shard gradients or zero2 gradients (every rank
  passes the same ones: the owner's gradient, or the placeholder where another rank owns
  it), and ``clip_grad_norm_`` (every
  reference to it: its total norm is looked up at call time) over shards or zero2
  parameters, return the norm of exactly the tensors given, across ranks (a collective),
  and clip with it. ``clip_grad_value_`` and ``clip_grads_with_norm_`` act element by element
  and are exact on slices as they are.
* ``parameters_to_vector`` / ``vector_to_parameters`` over zero3/hsdp parameters or
  their gradients raise, naming what to call instead (the vector would be this rank's).

Everything else passes through to torch unchanged. A module declares its split gradients
with ``split_gradients()``; :func:`track` registers it (weakly) and installs the wrappers.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.nn.utils import clip_grad, convert_parameters

from metadist.comm import ops
from metadist.runtime.world import Group
from metadist.strategies.tensors.shard_value import ShardValue


class Split(NamedTuple):
    """How a parameter's gradient is spread over ranks."""

    #: the ranks whose gradients add up to the global one
    group: Group
    #: this rank's gradient is its part of the global one (zero2: only the owner's is)
    mine: bool = True
    #: the parameter is a shard (zero3/hsdp), not one of the user's parameters
    shard: bool = True


class SplitSource(Protocol):
    def split_gradients(self) -> dict[torch.Tensor, Split]: ...


_TRACKED: weakref.WeakSet[Any] = weakref.WeakSet()
_STATIC: weakref.WeakKeyDictionary[Any, dict[int, Split]] = weakref.WeakKeyDictionary()
_ORIGINAL: dict[str, Any] = {}
_CLIP = ("torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or "
         "strategy.clip_grad_norm_(model, max_norm)")


def track(source: SplitSource) -> None:
    """Make torch's gradient utilities aware of ``source``'s split gradients."""
    _TRACKED.add(source)
    _install()


def forget(source: SplitSource) -> None:
    """``source``'s split gradients changed (zero3's flats were regrouped)."""
    _STATIC.pop(source, None)


def _install() -> None:
    if _ORIGINAL:
        return
    # Module globals too, not only the public names: torch's own functions look those up
    # when they run, so a reference taken before this (``from torch.nn.utils import
    # clip_grad_norm_``, ``parameters_to_vector``) reaches the wrappers as well.
    replaced: list[tuple[types.ModuleType, str, str, Callable[..., Any]]] = [
        (clip_grad, "_get_total_norm", "total", get_total_norm),
        (torch.nn.utils, "get_total_norm", "total", get_total_norm),
        (clip_grad, "clip_grad_norm_", "clip", clip_grad_norm_),
        (torch.nn.utils, "clip_grad_norm_", "clip", clip_grad_norm_),
        (clip_grad, "_group_tensors_by_device_and_dtype", "group", _group_guard),
        (convert_parameters, "_check_param_device", "check", _check_param_device),
    ]
    for namespace, name, key, _ in replaced:
        _ORIGINAL.setdefault(key, vars(namespace)[name])
    _ORIGINAL["total_code"] = inspect.unwrap(_ORIGINAL["total"]).__code__
    for namespace, name, key, wrapper in replaced:
        setattr(namespace, name, functools.wraps(_ORIGINAL[key])(wrapper))


def _static(source: SplitSource) -> dict[int, Split]:
    """id(parameter) -> Split of ``source`` (fixed at setup: computed once)."""
    known = _STATIC.get(source)
    if known is None:
        known = _STATIC[source] = {id(p): s for p, s in source.split_gradients().items()}
    return known


def _split_of(param: torch.Tensor) -> Split | None:
    for source in list(_TRACKED):
        split = _static(source).get(id(param))
        if split is not None:
            return split
    return None


def _splits() -> dict[int, Split]:
    """id(parameter) -> Split for every tracked parameter."""
    out: dict[int, Split] = {}
    for source in list(_TRACKED):
        out.update(_static(source))
    return out


def _grad_splits() -> dict[int, Split]:
    """id(gradient) -> Split, for the current gradients of tracked parameters."""
    out: dict[int, Split] = {}
    for source in list(_TRACKED):
        for p, split in source.split_gradients().items():
            if p.grad is not None:
                out[id(p.grad)] = split
    return out


def _norm_parts(parts: Sequence[tuple[torch.Tensor | None, Split | None]], norm_type: float,
                device: torch.device) -> torch.Tensor:
    """The norm one process would compute over the tensors of ``parts``, from each rank's:
    replicated tensors (no Split) count locally, split ones are summed (or maxed) across
    their group. Every group named in ``parts`` joins its collective, in the order the
    groups first appear (the same on every rank: ranks pass the same parameters), also on
    a rank that holds none of its gradients (``None``: zero2, not the owner)."""
    inf = norm_type == float("inf")
    if not norm_type > 0:
        raise ValueError(
            f"norm_type={norm_type} over gradients split across ranks: only a positive "
            "norm_type or inf adds up from the ranks' parts; use norm_type=2.0 (or inf)")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    local = zero.clone()
    groups: dict[int, tuple[Group, torch.Tensor]] = {}
    for t, split in parts:
        acc = local
        if split is not None:
            acc = groups.setdefault(id(split.group), (split.group, zero.clone()))[1]
            if not split.mine:
                continue
        if t is None or t.numel() == 0:
            continue
        g = t.detach()
        if inf:
            acc.copy_(torch.maximum(acc, g.abs().max().to(acc)))
        else:
            norm = torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
            acc.add_(norm.to(acc.device) ** norm_type)
    for group, acc in groups.values():
        ops.all_reduce(acc, "max" if inf else "sum", group=group)
        if inf:
            local.copy_(torch.maximum(local, acc))
        else:
            local.add_(acc)
    return local if inf else local ** (1.0 / norm_type)


def _finish(total: torch.Tensor, like: torch.Tensor, norm_type: float,
            error_if_nonfinite: bool) -> torch.Tensor:
    """``total`` as torch returns it (on the first tensor's device, in its dtype)."""
    dtype = like.dtype if like.is_floating_point() else torch.float32
    out = total.to(like.device, dtype)
    if error_if_nonfinite and not bool(torch.isfinite(out)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return out


@torch.no_grad()
def get_total_norm(tensors: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, foreach: bool | None = None
                   ) -> torch.Tensor:
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    splits = _grad_splits() if _TRACKED and listed else {}
    parts = [(t, splits.get(id(t))) for t in listed]
    if any(s is None and isinstance(t, ShardValue) for t, s in parts):
        raise ValueError(
            "a gradient norm over tensors computed from zero3/hsdp shards (not the shards' "
            "gradients themselves): this rank holds a slice of each, and which ranks hold "
            "the rest is known only for the gradients; take the norm of the gradients "
            f"(p.grad for p in model.parameters()) first, or use {_CLIP}")
    found = [s for _, s in parts if s is not None]
    if not found:
        result: torch.Tensor = _ORIGINAL["total"](listed, norm_type, error_if_nonfinite, foreach)
        return result
    # zero2: every rank passes the same gradients (the owner's, or a placeholder where
    # another rank owns it), so each group's all-reduce pairs and each counts once
    total = _norm_parts(parts, float(norm_type), listed[0].device)
    return _finish(total, listed[0], norm_type, error_if_nonfinite)


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    generator = isinstance(parameters, types.GeneratorType)
    listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    splits = _splits() if _TRACKED else {}
    parts = [(p, splits.get(id(p))) for p in listed]
    if not any(s is not None for _, s in parts):
        given: Any = (p for p in listed) if generator else listed  # torch warns on empty ones
        result: torch.Tensor = _ORIGINAL["clip"](given, max_norm, norm_type,
                                                 error_if_nonfinite, foreach)
        return result
    # By parameters, not gradients: a zero2 rank that owns none of them holds no gradient
    # yet must join the sum.
    with torch.no_grad():
        grads = [(p.grad, s) for p, s in parts]
        like = next((g for g, _ in grads if g is not None), listed[0])
        total = _norm_parts(grads, float(norm_type), like.device)
        total = _finish(total, like, norm_type, error_if_nonfinite)
        torch.nn.utils.clip_grads_with_norm_(listed, max_norm, total, foreach)
    return total


def _group_guard(tensorlistlist: Any, with_indices: bool = False) -> Any:
    """torch's ``get_total_norm`` reached without this module's wrapper (a reference taken
    before a sharded model was set up) on split gradients: refuse rather than return a part."""
    if _TRACKED and sys._getframe(1).f_code is _ORIGINAL["total_code"]:
        splits = _grad_splits()
        if any(id(t) in splits for t in tensorlistlist[0]):
            raise RuntimeError(
                "torch.nn.utils.get_total_norm was imported by name before metadist set up "
                "a model whose gradients are split across ranks, and that copy returns this "
                "rank's part of the norm; call torch.nn.utils.get_total_norm(...) through the "
                f"module (it is looked up at call time) or {_CLIP}")
    return _ORIGINAL["group"](tensorlistlist, with_indices)


def _check_param_device(param: torch.Tensor, old_param_device: int | None) -> int:
    """Seen by ``parameters_to_vector`` and ``vector_to_parameters`` for every tensor."""
    if _TRACKED:
        split = _split_of(param)
        if split is not None and split.shard:
            raise RuntimeError(
                "parameters_to_vector / vector_to_parameters over model.parameters() of a "
                "zero3/hsdp model: this rank holds a slice of each parameter, so the vector "
                "would be this rank's; use torch.cat([p.reshape(-1) for p in "
                "model.full_parameters().values()]) for the full vector (a collective), and "
                "model.load_state_dict to change parameters")
        # Gradients change every step, so finding them costs a pass over the tracked
        # parameters: done for a call's first tensor only (no device seen yet).
        if old_param_device is None and id(param) in _grad_splits():
            raise RuntimeError(
                "parameters_to_vector over gradients that are split across ranks (zero3/hsdp "
                "shards, zero2 owners): the vector would hold this rank's part only; use "
                f"{_CLIP} for the global norm")
    result: int = _ORIGINAL["check"](param, old_param_device)
    return result
