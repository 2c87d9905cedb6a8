"""Partitioners: split one call's arguments into ``(worker, args, kwargs)`` parts.

A partitioner is a worker id (``int`` rank or ``str`` name: the whole call runs there) or a
callable ``partitioner(*args, **kwargs) -> [(worker, args, kwargs), ...]``. The ones here
split every tensor in the (pytree of) arguments along one dimension and hand non-tensor
values unchanged to every part, as TorchOpt's ``torchopt.distributed`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree

from metadist.mapreduce import trees
from metadist.mapreduce.world import get_worker_id, get_world_rank, get_world_size

Args: TypeAlias = tuple[Any, ...]
KwArgs: TypeAlias = dict[str, Any]
WorkerId: TypeAlias = "int | str"
PartitionFunction: TypeAlias = Callable[..., Sequence[tuple[WorkerId, "Args | None",
                                                            "KwArgs | None"]]]
Partitioner: TypeAlias = "int | str | PartitionFunction"


@dataclass(frozen=True)
class Part:
    """One piece of a call: ``func(*args, **kwargs)`` on global rank ``worker``."""

    worker: int
    args: Args
    kwargs: KwArgs


def _where(flat_index: int, args: Args, kwargs: KwArgs) -> str:
    """Human-readable location (``args[1]['x']``) of the ``flat_index``-th pytree leaf."""
    with_path, _ = pytree.tree_flatten_with_path((args, kwargs))
    path = with_path[flat_index][0]
    root = "args" if getattr(path[0], "idx", 0) == 0 else "kwargs"
    return root + pytree.keystr(path[1:])


@dataclass(frozen=True)
class DimPartitioner:
    """Split tensors along ``dim``; see :func:`dim_partitioner`."""

    dim: int = 0
    exclusive: bool = False
    keepdim: bool = True
    workers: tuple[WorkerId, ...] | None = None

    def __post_init__(self) -> None:
        if not self.keepdim and not self.exclusive:
            raise ValueError("dim_partitioner(keepdim=False) drops the split dimension, which "
                             "only makes sense with one sample per part: pass exclusive=True "
                             "or keepdim=True")
        if self.workers is not None and len(self.workers) == 0:
            raise ValueError("dim_partitioner(workers=[]) has no worker to send parts to; pass "
                             "None (every worker) or at least one rank or worker name")

    def _size(self, args: Args, kwargs: KwArgs, leaves: list[Any]) -> int | None:
        size: int | None = None
        first = -1
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            if not -leaf.dim() <= self.dim < leaf.dim():
                raise ValueError(
                    f"dim_partitioner(dim={self.dim}): {_where(i, args, kwargs)} has shape "
                    f"{tuple(leaf.shape)}, which has no dimension {self.dim}; every tensor "
                    "argument is split, so pass unsplittable tensors inside a non-tensor "
                    "object or use a custom partitioner")
            if size is None:
                size, first = leaf.shape[self.dim], i
            elif leaf.shape[self.dim] != size:
                raise ValueError(
                    f"dim_partitioner(dim={self.dim}): every tensor argument must have the same "
                    f"size on dim {self.dim}, but {_where(first, args, kwargs)} has {size} "
                    f"(shape {tuple(leaves[first].shape)}) and {_where(i, args, kwargs)} has "
                    f"{leaf.shape[self.dim]} (shape {tuple(leaf.shape)}); make them match or "
                    "use a custom partitioner")
        return size

    def __call__(self, *args: Any, **kwargs: Any) -> list[tuple[int, Args, KwArgs]]:
        workers = ([get_worker_id(w) for w in self.workers] if self.workers is not None
                   else list(range(get_world_size())))
        leaves = trees.leaves((args, kwargs))
        size = self._size(args, kwargs, leaves)
        if size is None:  # nothing to split: the whole call runs on the calling worker
            return [(get_world_rank(), args, dict(kwargs))]
        selections: list[int | slice]
        if self.exclusive:  # one sample per part, dealt round-robin over the workers
            selections = [i if not self.keepdim else slice(i, i + 1) for i in range(size)]
        else:  # min(size, workers) contiguous parts whose sizes differ by at most one
            count = min(size, len(workers))
            lengths = [size // count + (i < size % count) for i in range(count)]
            starts = [sum(lengths[:i]) for i in range(count)]
            selections = [slice(a, a + n) for a, n in zip(starts, lengths, strict=True)]
        parts = []
        for i, sel in enumerate(selections):
            piece = [leaf[(slice(None),) * (self.dim % leaf.dim()) + (sel,)]
                     if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            part_args, part_kwargs = trees.refill((args, kwargs), piece)
            parts.append((workers[i % len(workers)], tuple(part_args), dict(part_kwargs)))
        return parts


def dim_partitioner(dim: int = 0, *, exclusive: bool = False, keepdim: bool = True,
                    workers: Sequence[WorkerId] | None = None) -> DimPartitioner:
    """Split every tensor argument along ``dim``; non-tensor arguments go to every part.

    Args:
        dim: the dimension to split; every tensor in the arguments must have the same size
            on it (a :class:`ValueError` says which ones do not).
        exclusive: one part per index along ``dim``, dealt round-robin over the workers
            (part i runs on ``workers[i % len(workers)]``, the caller's rank included).
            Otherwise ``min(size, len(workers))`` contiguous parts, part i on ``workers[i]``;
            uneven sizes differ by at most one, larger parts first.
        keepdim: keep the split dimension (size 1 when exclusive); ``False`` selects the
            index instead and needs ``exclusive=True``.
        workers: ranks or worker names to use, in order (default: every rank).

    With no tensor in the arguments the whole call runs on the calling worker.
    """
    return DimPartitioner(dim, exclusive, keepdim,
                          tuple(workers) if workers is not None else None)


batch_partitioner = dim_partitioner(0, exclusive=False, keepdim=True)
"""Split dim 0 into one contiguous part per worker (fewer when the batch is smaller)."""

exclusive_batch_partitioner = dim_partitioner(0, exclusive=True, keepdim=True)
"""One part per sample of dim 0 (kept as size 1), dealt round-robin over the workers."""


def partition(partitioner: Partitioner | None, args: Args, kwargs: KwArgs) -> list[Part]:
    """Apply ``partitioner`` (default :data:`batch_partitioner`) and check what it returned."""
    match partitioner:
        case None:
            raw: Sequence[Any] = batch_partitioner(*args, **kwargs)
        case bool():
            raise TypeError(f"partitioner must be a worker id or a callable, got {partitioner!r}")
        case int() | str():
            raw = [(partitioner, args, kwargs)]
        case _ if callable(partitioner):
            raw = partitioner(*args, **kwargs)
        case _:
            raise TypeError(
                f"partitioner must be a worker id (int rank or str name) or a callable "
                f"returning [(worker, args, kwargs), ...]; got {partitioner!r}")
    parts = []
    for i, item in enumerate(raw):
        if not (isinstance(item, (tuple, list)) and len(item) == 3):
            raise TypeError(f"partitioner {partitioner!r} returned {item!r} as part {i}; each "
                            "part must be a (worker, args, kwargs) triple")
        worker, part_args, part_kwargs = item
        parts.append(Part(get_worker_id(worker), tuple(part_args or ()), dict(part_kwargs or {})))
    return parts


__all__ = [
    "Args",
    "DimPartitioner",
    "KwArgs",
    "Part",
    "PartitionFunction",
    "Partitioner",
    "batch_partitioner",
    "dim_partitioner",
    "exclusive_batch_partitioner",
    "partition",
]
