"""The rpc engine: torch.distributed.rpc plus distributed autograd, behind metadist's API.

TensorPipe RPC is in maintenance mode upstream, so nothing outside this file touches it: the
rendezvous comes from metadist's runtime (rank 0 picks a free port, distinct from the process
group's, and broadcasts it), and modules are sent with their parameters as differentiable
clones: a plain ``nn.Parameter`` pickled over RPC arrives detached and its gradient is
silently lost (pytorch#86525). Without ``rpc_backend_options`` RPC runs over TCP only
(TensorPipe's shared-memory transport answers faster but busy-polls a core per process).
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from metadist.comm import ops
from metadist.errors import MetadistError
from metadist.mapreduce import trees
from metadist.mapreduce.functions import unwrap
from metadist.mapreduce.modules import copy_module
from metadist.mapreduce.partitioners import Part
from metadist.mapreduce.world import worker_name
from metadist.runtime import env as launch_env
from metadist.runtime import world as _world

try:
    from torch.distributed import rpc as _rpc

    AVAILABLE = bool(_rpc.is_available())
except ImportError:  # builds without distributed support
    AVAILABLE = False

# For scripts that pass remote references explicitly (TorchOpt's examples do).
RRef: Any = _rpc.RRef if AVAILABLE else None

_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

def _free_port(addr: str) -> int:
    host = addr if addr == launch_env.LOOPBACK else ""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start(config: Any) -> None:
    """Start RPC on every rank (collective over the process group)."""
    if not AVAILABLE:
        raise MetadistError("this torch build has no torch.distributed.rpc; use the spmd engine "
                            "(engine='spmd')")
    w = _world.world()
    addr = launch_env.detect().master_addr or launch_env.LOOPBACK
    port = ops.broadcast_object(_free_port(addr) if w.rank == 0 else None)
    # By default TCP only: TensorPipe's shared-memory transport busy-polls, costing every
    # process a core even while idle (measured here: ~1 CPU-second per second), which on small
    # machines is the core the computation needs. Pass rpc_backend_options to choose.
    options = config.rpc_backend_options or _rpc.TensorPipeRpcBackendOptions(
        _transports=["uv"])
    options.init_method = f"tcp://{addr}:{port}"
    # Under torchrun this variable makes every rank a client of the agent's store, but the
    # store for this fresh port is ours to serve from rank 0 (which also keeps a restarted
    # attempt from reading the previous attempt's keys).
    agent_store = os.environ.pop(_AGENT_STORE, None)
    try:
        _rpc.init_rpc(worker_name(w.rank), backend=config.rpc_backend, rank=w.rank,
                      world_size=w.world_size, rpc_backend_options=options)
    finally:
        if agent_store is not None:
            os.environ[_AGENT_STORE] = agent_store


def stop() -> None:
    """Wait for every worker's outstanding calls, then stop RPC (collective)."""
    _rpc.shutdown(graceful=True)


def _differentiable_clone(p: torch.Tensor) -> torch.Tensor:
    return p.clone() if p.requires_grad else p


def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...],
                                                                   dict[str, Any]]:
    """Arguments safe to send: parameters (loose or in modules) become clones in the graph."""
    memo: dict[int, nn.Module] = {}

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, nn.Module):
            return copy_module(leaf, _differentiable_clone, lambda b: b, memo)
        if isinstance(leaf, nn.Parameter):
            return _differentiable_clone(leaf)
        return leaf

    new_args, new_kwargs = trees.tree_map(convert, (args, kwargs))
    return tuple(new_args), dict(new_kwargs)


def _invoke(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs on the worker. A ``parallelize``d function arrives as its wrapper (that is what
    its module-level name refers to); call the function inside it, not another round trip."""
    return unwrap(func)(*args, **kwargs)


def execute(func: Callable[..., Any], parts: list[Part],
            reducer: Callable[[list[Any]], Any] | None,
            timeout: float | None) -> torch.futures.Future[Any]:
    """Send each part to its worker; a future of the results in part order (or reduced)."""
    futures = []
    for part in parts:
        try:
            futures.append(_rpc.rpc_async(
                part.worker, _invoke, args=(func, part.args, part.kwargs),
                timeout=-1.0 if timeout is None else timeout))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            name = getattr(func, "__qualname__", repr(func))
            raise ValueError(
                f"the rpc engine could not send the call of {name} to worker {part.worker}: "
                f"{exc}. Functions travel by reference, so they must be defined at module level "
                "of a module every worker imports, and arguments must be picklable") from exc
    gathered: torch.futures.Future[Any] = torch.futures.collect_all(futures).then(
        lambda done: [f.wait() for f in done.value()])
    if reducer is None:
        return gathered
    return gathered.then(lambda done: reducer(done.value()))


__all__ = ["AVAILABLE", "execute", "prepare", "start", "stop"]
