"""The spmd engine: every rank runs the program and computes the parts assigned to it.

One call, on every rank:
  1. tensors that need gradients in the arguments (loose, or a module's parameters) are
     *tied* (see ``tie.py``): same values, gradients summed over ranks in backward;
  2. the partitioner splits the arguments; parts assigned to this rank run here, each with a
     private copy of any module argument (tied parameters, cloned buffers), as an RPC would
     unpickle one;
  3. one byte exchange carries every rank's plan fingerprint, failure and results (small
     tensors by value; large ones follow in one all-reduce per dtype);
  4. every rank rebuilds all results in partition order; those that need gradients come out
     of ``combine``, whose backward returns each rank its parts' share, and the reducer runs
     on identical inputs everywhere, so the objective is the same on every rank.
Backward then costs one fused all-reduce of the tied tensors' gradients (like DDP) and the
gradients equal the single-process ones on every rank, to any order.

A call made inside a part (nested parallelism) runs all its parts locally.
"""

from __future__ import annotations

import math
import pickle
import threading
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from metadist.comm import ops
from metadist.errors import MetadistError
from metadist.mapreduce import tie as _tie
from metadist.mapreduce import trees
from metadist.mapreduce.exchange import exchange
from metadist.mapreduce.functions import inner_function
from metadist.mapreduce.modules import clone_buffer, copy_module
from metadist.mapreduce.partitioners import Args, KwArgs, Part, Partitioner, partition
from metadist.runtime import world as _world

SMALL_NUMEL = 4096  # tensors up to this size travel inside the byte exchange

_local = threading.local()


class PartFailedError(MetadistError):
    """A part of a map-reduce call raised; raised on every rank, naming the part and rank."""


@dataclass(frozen=True)
class _TensorLeaf:
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_cpu: bool
    requires_grad: bool
    values: Any  # nested lists (small tensors), None when sent through the all-reduce


@dataclass(frozen=True)
class _Payload:
    plan: int  # fingerprint of this rank's partition plan
    workers: tuple[int, ...]
    all_local: bool
    error: tuple[int, str, str, str] | None  # part, exception type, message, traceback
    results: dict[int, Any]  # part -> its result, tensors replaced by _TensorLeaf


def _fingerprint(workers: tuple[int, ...], leaves: list[Any]) -> int:
    """Which worker runs each part, and the shapes of the tensors the call was made with."""
    shapes = [(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)]
    return zlib.crc32(repr((workers, shapes)).encode())


def _tie_arguments(args: Args, kwargs: KwArgs) -> tuple[Args, KwArgs, list[Any],
                                                        dict[int, torch.Tensor],
                                                        list[torch.Tensor]]:
    """Tie every tensor needing a gradient; loose ones are replaced, module parameters are
    looked up in the returned map when each part gets its copy."""
    leaves = trees.leaves((args, kwargs))
    found: dict[int, torch.Tensor] = {}
    for leaf in leaves:
        params = leaf.parameters() if isinstance(leaf, nn.Module) else (
            [leaf] if isinstance(leaf, torch.Tensor) else [])
        for t in params:
            if t.requires_grad and id(t) not in found:
                found[id(t)] = t
    if not found:
        return args, kwargs, leaves, {}, []
    tied = _tie.tie(list(found.values()))
    mapping = dict(zip(found, tied, strict=True))
    new_args, new_kwargs = trees.refill((args, kwargs), [
        mapping.get(id(leaf), leaf) if isinstance(leaf, torch.Tensor) else leaf
        for leaf in leaves])
    return tuple(new_args), dict(new_kwargs), leaves, mapping, tied[:1]


def _private(part: Part, params: dict[int, torch.Tensor]) -> Part:
    """The part with each module argument replaced by its own copy."""
    memo: dict[int, nn.Module] = {}

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, nn.Module):
            return copy_module(leaf, lambda p: params.get(id(p), p), clone_buffer, memo)
        return leaf

    args, kwargs = trees.tree_map(convert, (part.args, part.kwargs))
    return Part(part.worker, tuple(args), dict(kwargs))


def _run(func: Callable[..., Any], part: Part) -> Any:
    target = inner_function(func)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return target(*part.args, **part.kwargs)
    finally:
        _local.depth -= 1


def _encode(result: Any) -> Any:
    """The result with each tensor replaced by its description (and small values); the
    structure pickles as is (a TreeSpec would too, but unpickling one warns on torch 2.13)."""
    def describe(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        small = leaf.numel() <= SMALL_NUMEL
        return _TensorLeaf(leaf.dtype, tuple(leaf.shape), leaf.device.type == "cpu",
                           leaf.requires_grad, leaf.detach().cpu().tolist() if small else None)

    return trees.tree_map(describe, result)


def _local_only(func: Callable[..., Any], parts: list[Part]) -> list[Any]:
    return [_run(func, _private(p, {})) for p in parts]


def _fail(payloads: list[_Payload], name: str, mine: BaseException | None) -> PartFailedError:
    rank, error = next((r, p.error) for r, p in enumerate(payloads) if p.error is not None)
    part, exc_type, message, tb = error
    err = PartFailedError(f"part {part} of {name} failed on rank {rank} with {exc_type}: "
                          f"{message}\n--- traceback on rank {rank} ---\n{tb.rstrip()}")
    err.__cause__ = mine if _world.world().rank == rank else None
    return err


def _check_plans(payloads: list[_Payload], name: str) -> bool:
    """True when every rank made the same plan; False when every rank's plan is entirely its
    own (each call then stands alone); otherwise raise."""
    if all(p.plan == payloads[0].plan for p in payloads):
        return True
    if all(p.all_local for p in payloads):
        return False
    described = "; ".join(f"rank {r}: parts on workers {list(p.workers)}"
                          for r, p in enumerate(payloads))
    raise ValueError(
        f"ranks split the call of {name} differently ({described}). Under the spmd engine every "
        "rank runs the same program, so every rank must make the same call with arguments of "
        "the same shapes; for a program where only rank 0 drives, use engine='rpc'")


def _device(leaf: _TensorLeaf) -> torch.device:
    return torch.device("cpu") if leaf.on_cpu else _world.world().device


def _rebuild(payloads: list[_Payload], parts: list[Part], local: dict[int, Any],
             anchors: list[torch.Tensor]) -> list[Any]:
    shapes = [payloads[part.worker].results[i] for i, part in enumerate(parts)]
    leaves = [trees.leaves(shape) for shape in shapes]
    mine_local = {i: trees.leaves(local[i]) for i in local}
    large: dict[tuple[torch.dtype, bool], list[tuple[int, int]]] = {}
    grad_slots: list[tuple[int, int]] = []
    for i, row in enumerate(leaves):
        for j, leaf in enumerate(row):
            if not isinstance(leaf, _TensorLeaf):
                continue
            if leaf.requires_grad:
                grad_slots.append((i, j))
            if leaf.values is None:  # every rank lists it, so every rank joins its all-reduce
                large.setdefault((leaf.dtype, leaf.on_cpu), []).append((i, j))
            elif i in mine_local:
                row[j] = mine_local[i][j].detach().clone()
            else:
                row[j] = torch.tensor(leaf.values, dtype=leaf.dtype).to(_device(leaf))
    for slots in large.values():
        _fill_large(leaves, slots, mine_local)
    if grad_slots:
        mine = [k for k, (i, _) in enumerate(grad_slots) if i in mine_local]
        local_inputs = [mine_local[grad_slots[k][0]][grad_slots[k][1]] for k in mine]
        if not any(t.requires_grad for t in (*local_inputs, *anchors)):
            # Results need gradients on other ranks: make this rank's copies need them too, so
            # every rank's objective has the same graph shape.
            anchors = [torch.zeros((), requires_grad=True)]
        values = [leaves[i][j] for i, j in grad_slots]
        for (i, j), out in zip(grad_slots, _tie.combine(values, local_inputs, mine, anchors),
                               strict=True):
            leaves[i][j] = out
    return [trees.refill(shape, row) for shape, row in zip(shapes, leaves, strict=True)]


def _fill_large(leaves: list[list[Any]], slots: list[tuple[int, int]],
                mine_local: dict[int, list[Any]]) -> None:
    """Values of large tensors: owners write theirs into a zero buffer, one sum all-reduce
    (exact: every position has one non-zero contribution at most)."""
    metas: list[_TensorLeaf] = [leaves[i][j] for i, j in slots]
    dtype = metas[0].dtype
    wire = torch.uint8 if dtype == torch.bool else dtype  # gloo cannot sum booleans
    sizes = [math.prod(m.shape) for m in metas]
    flat = torch.zeros(sum(sizes), dtype=wire, device=_device(metas[0]))
    offset = 0
    for (i, j), n in zip(slots, sizes, strict=True):
        if i in mine_local:
            flat[offset:offset + n] = mine_local[i][j].detach().reshape(-1).to(wire)
        offset += n
    ops.all_reduce(flat, "sum")
    for (i, j), piece, meta in zip(slots, flat.split(sizes), metas, strict=True):
        leaves[i][j] = piece.to(dtype).reshape(meta.shape)


def execute(func: Callable[..., Any], args: Args, kwargs: KwArgs,
            partitioner: Partitioner | None,
            reducer: Callable[[list[Any]], Any] | None) -> torch.futures.Future[Any]:
    """Run one map-reduce call on this rank; every rank must make the same call."""
    name = getattr(func, "__qualname__", repr(func))
    future: torch.futures.Future[Any] = torch.futures.Future()
    world = _world.world()
    if world.world_size == 1 or getattr(_local, "depth", 0) > 0:
        results = _local_only(func, partition(partitioner, args, kwargs))
        return _finish(future, results, reducer)
    args, kwargs, arg_leaves, tied, anchors = _tie_arguments(args, kwargs)
    parts = partition(partitioner, args, kwargs)
    workers = tuple(p.worker for p in parts)
    local: dict[int, Any] = {}
    error: tuple[int, str, str, str] | None = None
    raised: BaseException | None = None
    for i, part in enumerate(parts):
        if part.worker != world.rank:
            continue
        try:
            local[i] = _run(func, _private(part, tied))
        except Exception as exc:
            error, raised = (i, type(exc).__name__, str(exc), traceback.format_exc()), exc
            break
    try:
        encoded = {i: _encode(r) for i, r in local.items()} if error is None else {}
    except Exception as exc:  # e.g. a result leaf that cannot be pickled
        error, raised, encoded = (min(local), type(exc).__name__, str(exc),
                                  traceback.format_exc()), exc, {}
    mine = _Payload(_fingerprint(workers, arg_leaves), workers,
                    all(w == world.rank for w in workers), error, encoded)
    try:
        blob = pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        blob = pickle.dumps(_Payload(mine.plan, mine.workers, mine.all_local,
                                     (min(local, default=0), type(exc).__name__,
                                      f"a result could not be pickled: {exc}", ""), {}))
    try:
        blobs = exchange(blob)
    except Exception as exc:
        raise MetadistError(
            f"the map-reduce call of {name} could not reach every rank ({type(exc).__name__}). "
            "Under the spmd engine every rank must make every call; a training loop that only "
            "rank 0 runs (e.g. under @rank_zero_only) needs engine='rpc'") from exc
    payloads: list[_Payload] = [pickle.loads(b) for b in blobs]
    if any(p.error is not None for p in payloads):
        future.set_exception(_fail(payloads, name, raised))
        return future
    if not _check_plans(payloads, name):
        return _finish(future, [local[i] for i in range(len(parts))], reducer)
    return _finish(future, _rebuild(payloads, parts, local, anchors), reducer)


def _finish(future: torch.futures.Future[Any], results: list[Any],
            reducer: Callable[[list[Any]], Any] | None) -> torch.futures.Future[Any]:
    try:
        future.set_result(results if reducer is None else reducer(results))
    except Exception as exc:
        future.set_exception(exc)
    return future


__all__ = ["PartFailedError", "execute"]
