"""``torchopt.distributed.api`` on metadist: partitioners, reducers and map-reduce calls with
TorchOpt's signatures, defaults and split rules, run by metadist's engines.

Where TorchOpt's semantics differ from metadist's own API, this module has TorchOpt's:

* a non-exclusive split of ``n`` samples over ``w < n`` workers gives every part ``n // w``
  samples and the last part the rest (arange(5) on 2 workers: [0:2] and [2:5]; metadist's
  :func:`metadist.mapreduce.dim_partitioner` spreads the rest: [0:3] and [3:5]), so
  :func:`mean_reducer`, an unweighted mean of the parts' results, sees other parts;
* :class:`TensorDimensionPartitioner` defaults to ``keepdim=False`` (which needs
  ``exclusive=True``), :func:`dim_partitioner` to ``keepdim=True``;
* the calls take their arguments by keyword only.

Module arguments are sent with their parameters differentiable (metadist's rpc engine; torch
alone would detach them), and functions of the script travel by name (see ``_session``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias, TypeVar

import torch

from metadist.compat.torchopt.distributed import _session
from metadist.compat.torchopt.distributed.world import (
    get_worker_id,
    get_world_rank,
    get_world_size,
)
from metadist.mapreduce import parallel as mr_parallel
from metadist.mapreduce import trees
from metadist.mapreduce.functions import mark_wrapper
from metadist.mapreduce.reducers import mean_reducer, sum_reducer

T = TypeVar("T")
U = TypeVar("U")
Args: TypeAlias = tuple[Any, ...]
KwArgs: TypeAlias = dict[str, Any]
PartitionFunction: TypeAlias = Callable[..., Sequence[tuple[int, "Args | None",
                                                            "KwArgs | None"]]]
Partitioner: TypeAlias = "int | str | PartitionFunction"
ReduceFn: TypeAlias = Callable[[Iterable[Any]], Any]

UNSET_RPC_TIMEOUT = -1.0
"""torch's "no timeout given": RPC's default timeout applies (60 s unless configured)."""


class TensorDimensionPartitioner:
    """Split every tensor argument along ``dim``; other arguments go to every part.

    Args:
        dim: the dimension to split; every tensor argument must have the same size on it.
        exclusive: one part per index along ``dim``, part i on ``workers[i % len(workers)]``.
            Otherwise ``min(size, len(workers))`` contiguous parts: one sample each when there
            are no more samples than workers, else ``size // len(workers)`` samples each and
            the remainder added to the last part.
        keepdim: keep the split dimension (size 1 when exclusive); ``False`` (the default here,
            not in :func:`dim_partitioner`) selects the index and needs ``exclusive=True``.
        workers: ranks or worker names to use, in order (default: every worker).

    With no tensor in the arguments the whole call runs on the calling worker.
    """

    def __init__(self, dim: int, *, exclusive: bool = False, keepdim: bool = False,
                 workers: Sequence[int | str] | None = None) -> None:
        if not keepdim and not exclusive:
            raise ValueError(
                "TensorDimensionPartitioner(keepdim=False) drops the split dimension, which "
                "needs one sample per part: pass exclusive=True, or keepdim=True to keep it "
                "(dim_partitioner() keeps it by default)")
        if workers is not None and len(workers) == 0:
            raise ValueError("TensorDimensionPartitioner(workers=[]) has no worker to send "
                             "parts to; pass None (every worker) or ranks or worker names")
        self.dim = dim
        self.exclusive = exclusive
        self.keepdim = keepdim
        self.workers = workers

    def __repr__(self) -> str:
        return (f"TensorDimensionPartitioner({self.dim}, exclusive={self.exclusive}, "
                f"keepdim={self.keepdim}, workers={self.workers!r})")

    def _size(self, leaves: list[Any]) -> int | None:
        size: int | None = None
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                continue
            if not -leaf.dim() <= self.dim < leaf.dim():
                raise ValueError(
                    f"{self!r}: a tensor argument of shape {tuple(leaf.shape)} has no dimension "
                    f"{self.dim}; every tensor argument is split, so pass the others inside a "
                    "non-tensor object or write your own partitioner")
            if size is None:
                size = leaf.shape[self.dim]
            elif leaf.shape[self.dim] != size:
                raise ValueError(
                    f"{self!r}: tensor arguments differ in size on dim {self.dim} ({size} and "
                    f"{leaf.shape[self.dim]}, shape {tuple(leaf.shape)}); make them match or "
                    "write your own partitioner")
        return size

    def _selections(self, size: int, workers: int) -> list[int | slice]:
        if self.exclusive:
            return [slice(i, i + 1) if self.keepdim else i for i in range(size)]
        if size <= workers:
            return [slice(i, i + 1) for i in range(size)]
        step = size // workers
        bounds = [i * step for i in range(workers)] + [size]  # the last part takes the rest
        return [slice(bounds[i], bounds[i + 1]) for i in range(workers)]

    def __call__(self, *args: Any, **kwargs: Any) -> list[tuple[int, Args, KwArgs]]:
        """The parts: ``[(worker rank, args, kwargs), ...]``."""
        workers = ([get_worker_id(w) for w in self.workers] if self.workers is not None
                   else list(range(get_world_size())))
        leaves = trees.leaves((args, kwargs))
        size = self._size(leaves)
        if size is None:
            return [(get_world_rank(), args, dict(kwargs))]
        parts = []
        for i, selection in enumerate(self._selections(size, len(workers))):
            piece = [leaf[(slice(None),) * (self.dim % leaf.dim()) + (selection,)]
                     if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            part_args, part_kwargs = trees.refill((args, kwargs), piece)
            parts.append((workers[i % len(workers)], tuple(part_args), dict(part_kwargs)))
        return parts


def dim_partitioner(dim: int = 0, *, exclusive: bool = False, keepdim: bool = True,
                    workers: Sequence[int | str] | None = None) -> PartitionFunction:
    """A :class:`TensorDimensionPartitioner` (note: ``keepdim`` defaults to ``True`` here)."""
    return TensorDimensionPartitioner(dim, exclusive=exclusive, keepdim=keepdim,
                                      workers=workers)


batch_partitioner: PartitionFunction = dim_partitioner(dim=0, keepdim=True, exclusive=False)
"""Split dim 0 into ``min(batch, workers)`` contiguous parts (the last takes the rest)."""

exclusive_batch_partitioner: PartitionFunction = dim_partitioner(dim=0, keepdim=True,
                                                                 exclusive=True)
"""One part per sample of dim 0 (kept as size 1), dealt round-robin over the workers."""


def _timeout(timeout: float | None) -> float | None:
    return None if timeout is None or timeout == UNSET_RPC_TIMEOUT else timeout


def remote_async_call(func: Callable[..., T], *, args: Args | None = None,
                      kwargs: KwArgs | None = None, partitioner: Partitioner | None = None,
                      reducer: Callable[[Iterable[T]], U] | None = None,
                      timeout: float | None = UNSET_RPC_TIMEOUT) -> torch.futures.Future[Any]:
    """Run ``func`` on the parts ``partitioner`` (default :data:`batch_partitioner`) makes of
    the arguments; a :class:`torch.futures.Future` of ``reducer(results)``, or of the
    results in part order when there is no reducer. Starts the session if none runs."""
    config = _session.start()
    if partitioner is None:
        partitioner = batch_partitioner
    elif isinstance(partitioner, bool) or not (isinstance(partitioner, (int, str))
                                               or callable(partitioner)):
        raise ValueError(f"partitioner must be a worker id (int rank or str worker name) or a "
                         f"callable returning [(worker, args, kwargs), ...]; got {partitioner!r}")
    target = _session.sendable(func) if config.engine == "rpc" else func
    return mr_parallel.remote_async_call(target, args, kwargs, partitioner, reducer,
                                         _timeout(timeout))


def remote_sync_call(func: Callable[..., T], *, args: Args | None = None,
                     kwargs: KwArgs | None = None, partitioner: Partitioner | None = None,
                     reducer: Callable[[Iterable[T]], U] | None = None,
                     timeout: float | None = UNSET_RPC_TIMEOUT) -> Any:
    """:func:`remote_async_call` and wait: the reduced result, or the list of results."""
    return remote_async_call(func, args=args, kwargs=kwargs, partitioner=partitioner,
                             reducer=reducer, timeout=timeout).wait()


def _decorator(partitioner: Partitioner | None, reducer: ReduceFn | None,
               timeout: float | None, wait: bool) -> Callable[[Callable[..., Any]],
                                                              Callable[..., Any]]:
    if partitioner is None:  # TorchOpt: the default reducer only comes with the default split
        partitioner = batch_partitioner
        if reducer is None:
            reducer = mean_reducer

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # The wrapper is what its module-level name refers to, so it is what travels;
            # whoever runs a part calls the function inside it instead of calling again.
            future = remote_async_call(wrapped, args=args, kwargs=kwargs,
                                       partitioner=partitioner, reducer=reducer,
                                       timeout=timeout)
            return future.wait() if wait else future

        mark_wrapper(wrapped, func)
        return wrapped

    return decorate


def parallelize_async(partitioner: Partitioner | None = None,
                      reducer: ReduceFn | None = None,
                      timeout: float | None = UNSET_RPC_TIMEOUT) -> Callable[
                          [Callable[..., Any]], Callable[..., Any]]:
    """Decorator: calling the function makes a map-reduce call and returns its future.

    Without a partitioner: :data:`batch_partitioner`, and :func:`mean_reducer` unless a
    reducer is given; with one, no reducer unless given (the list of results). Under rpc the
    function must be defined at module level.
    """
    return _decorator(partitioner, reducer, timeout, wait=False)


def parallelize(partitioner: Partitioner | None = None, reducer: ReduceFn | None = None,
                timeout: float | None = UNSET_RPC_TIMEOUT) -> Callable[[Callable[..., Any]],
                                                                       Callable[..., Any]]:
    """Like :func:`parallelize_async`, but calling the function returns the result."""
    return _decorator(partitioner, reducer, timeout, wait=True)


parallelize_sync = parallelize

__all__ = [
    "TensorDimensionPartitioner",
    "batch_partitioner",
    "dim_partitioner",
    "mean_reducer",
    "parallelize",
    "parallelize_async",
    "parallelize_sync",
    "remote_async_call",
    "remote_sync_call",
    "sum_reducer",
]
