"""Map-reduce calls: partition the arguments, run the function on the parts' workers,
reduce the results. The engine chosen at :func:`~metadist.mapreduce.init` does the running.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from metadist.mapreduce import rpc, spmd
from metadist.mapreduce.functions import mark_wrapper
from metadist.mapreduce.partitioners import Partitioner, batch_partitioner, partition
from metadist.mapreduce.reducers import mean_reducer
from metadist.mapreduce.session import ensure_started

T = TypeVar("T")
ReduceFn = Callable[[list[Any]], Any]


def remote_async_call(func: Callable[..., Any], args: tuple[Any, ...] | None = None,
                      kwargs: dict[str, Any] | None = None,
                      partitioner: Partitioner | None = None, reducer: ReduceFn | None = None,
                      timeout: float | None = None) -> torch.futures.Future[Any]:
    """Run ``func`` on the parts ``partitioner`` makes of ``args``/``kwargs``; a future of
    ``reducer(results)``, or of the results in part order when there is no reducer.

    ``partitioner``: a worker id (rank or name) or a callable (default
    :data:`~metadist.mapreduce.batch_partitioner`). ``timeout`` (seconds) applies to rpc.
    Under spmd every rank makes the call; under rpc any rank may.
    """
    config = ensure_started()
    call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
    match config.engine:
        case "spmd":
            return spmd.execute(func, call_args, call_kwargs, partitioner, reducer)
        case "rpc":
            call_args, call_kwargs = rpc.prepare(call_args, call_kwargs)
            return rpc.execute(func, partition(partitioner, call_args, call_kwargs), reducer,
                               timeout)
        case other:
            raise AssertionError(f"unknown engine {other!r}")  # session validated it


def remote_sync_call(func: Callable[..., Any], args: tuple[Any, ...] | None = None,
                     kwargs: dict[str, Any] | None = None,
                     partitioner: Partitioner | None = None, reducer: ReduceFn | None = None,
                     timeout: float | None = None) -> Any:
    """:func:`remote_async_call` and wait: the reduced result (or the list of results)."""
    return remote_async_call(func, args, kwargs, partitioner, reducer, timeout).wait()


def _decorator(partitioner: Partitioner | None, reducer: ReduceFn | None,
               timeout: float | None, wait: bool) -> Callable[[Callable[..., Any]],
                                                              Callable[..., Any]]:
    if partitioner is None:  # the data-parallel default: split the batch, average the results
        partitioner = batch_partitioner
        reducer = mean_reducer if reducer is None else reducer

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # The wrapper itself is what gets sent under rpc: its module-level name refers to
            # it, so it pickles by reference, and the worker unwraps it (rpc._invoke).
            future = remote_async_call(wrapper, args, kwargs, partitioner, reducer, timeout)
            return future.wait() if wait else future

        mark_wrapper(wrapper, func)
        return wrapper

    return decorate


def parallelize(partitioner: Partitioner | None = None, reducer: ReduceFn | None = None,
                timeout: float | None = None) -> Callable[[Callable[..., Any]],
                                                          Callable[..., Any]]:
    """Decorator: calling the function makes a map-reduce call and returns its result.

    Without a partitioner, :data:`~metadist.mapreduce.batch_partitioner` with
    :func:`~metadist.mapreduce.mean_reducer` (unless a reducer is given).
    Under rpc the decorated function must live at module level.
    """
    return _decorator(partitioner, reducer, timeout, wait=True)


def parallelize_async(partitioner: Partitioner | None = None, reducer: ReduceFn | None = None,
                      timeout: float | None = None) -> Callable[[Callable[..., Any]],
                                                                Callable[..., Any]]:
    """Like :func:`parallelize`, but calling the function returns a future."""
    return _decorator(partitioner, reducer, timeout, wait=False)


parallelize_sync = parallelize

__all__ = ["parallelize", "parallelize_async", "parallelize_sync", "remote_async_call",
           "remote_sync_call"]
