"""The rpc engine: torch.distributed.rpc plus distributed autograd, behind metadist's API.

TensorPipe RPC is in maintenance mode upstream, so nothing outside this file touches it. Modules
are sent with their parameters as differentiable clones: a plain ``nn.Parameter`` pickled over
RPC arrives detached and its gradient is silently lost (pytorch#86525). Without
``rpc_backend_options`` RPC runs over TCP only (TensorPipe's shared-memory transport answers
faster but busy-polls a core per process).

RPC's rendezvous goes through the store metadist's process group already uses (a rendezvous
handler hands torch a prefix of it), so starting RPC opens no new store port: torch's
``tcp://`` rendezvous would create a store listening on every interface. When the job's master
address is loopback, TensorPipe's listeners (``TP_SOCKET_IFNAME``) and the gloo group RPC
creates for itself (``GLOO_SOCKET_IFNAME``) are pinned to the loopback interface too, unless
those variables are set; on several nodes both keep their defaults (set them to the private
interface).

No wait is unbounded: calls time out after the job's collective limit (``METADIST_TIMEOUT``;
torch's default is a minute) unless ``rpc_backend_options`` say otherwise; the graceful
shutdown, which torch lets wait forever for a worker that never arrives, waits only for
workers whose heartbeat keeps coming (mapreduce/rpc_liveness.py: a serving rank may wait
there as long as the driver trains, not for a stopped, dead or unreachable one), and then
runs torch's shutdown within the limit; one that still does not return ends the process.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import urllib.parse
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from metadist.comm import ops
from metadist.errors import MetadistError
from metadist.mapreduce import rpc_liveness, rpc_shared, trees
from metadist.mapreduce.functions import inner_function
from metadist.mapreduce.modules import copy_module
from metadist.mapreduce.partitioners import Part
from metadist.mapreduce.world import worker_name
from metadist.runtime import env as launch_env
from metadist.runtime import watchdog
from metadist.runtime import world as _world
from metadist.runtime.bounded_store import StoreLostError
from metadist.runtime.rendezvous import is_loopback, loopback_interface

try:
    from torch.distributed import rpc as _rpc

    AVAILABLE = bool(_rpc.is_available())
except ImportError:  # builds without distributed support
    AVAILABLE = False

# For scripts that pass remote references explicitly (TorchOpt's examples do).
RRef: Any = _rpc.RRef if AVAILABLE else None

_SCHEME = "metadist-rpc"  # init_method metadist-rpc://<session token>
_SHUTDOWN_MARGIN_S = 5.0  # past the limit, a shutdown that has not returned ends the process
_liveness: rpc_liveness.Liveness | None = None  # this session's heartbeat
_IFNAME_VARS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")  # TensorPipe's, RPC's gloo group's
# torch's RPC passes its private gloo backend to all_gather_object, which then warns about
# "using a Backend as a ProcessGroup": torch's own usage, nothing the user can change.
_SPURIOUS = r"You are using a Backend .*ProcessGroupGloo.* as a ProcessGroup"


def _default_store() -> Any:
    """The store of the default process group (metadist's, or the one the user created)."""
    return dist.distributed_c10d._get_default_store()


def _rendezvous(url: str, **_: Any) -> Iterator[tuple[Any, int, int]]:
    """torch rendezvous handler: a prefix of the store this process already joined."""
    parsed = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parsed.query))
    rank, size = int(query["rank"]), int(query["world_size"])
    # A world of one has no process group (metadist opens no socket for it): a local store.
    base = dist.HashStore() if size == 1 else _default_store()  # type: ignore[attr-defined]
    prefixed = dist.PrefixStore(f"metadist/rpc/{parsed.netloc}", base)  # type: ignore[attr-defined]
    yield prefixed, rank, size


def _register() -> None:
    try:
        dist.register_rendezvous_handler(_SCHEME, _rendezvous)  # type: ignore[attr-defined]
    except RuntimeError as exc:  # registered by an earlier session of this process
        if "already registered" not in str(exc):
            raise


def loopback_pins(master_addr: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The interface variables to set while RPC starts: loopback for a job whose master
    address is loopback (one machine), nothing on several nodes or where the user chose."""
    environ = os.environ if environ is None else environ
    lo = loopback_interface()
    if lo is None or not is_loopback(master_addr):
        return {}
    return {name: lo for name in _IFNAME_VARS if not environ.get(name)}


@contextlib.contextmanager
def _scoped_env(values: dict[str, str]) -> Iterator[None]:
    for name, value in values.items():
        os.environ[name] = value
    try:
        yield
    finally:
        for name in values:
            os.environ.pop(name, None)


def start(config: Any) -> None:
    """Start RPC on every rank (collective over the process group)."""
    if not AVAILABLE:
        raise MetadistError("this torch build has no torch.distributed.rpc; use the spmd engine "
                            "(engine='spmd')")
    w = _world.world()
    _register()
    # A fresh prefix per session: RPC started again must not read the last session's keys.
    token = ops.broadcast_object(uuid.uuid4().hex if w.rank == 0 else None)
    # By default TCP only: TensorPipe's shared-memory transport busy-polls, costing every
    # process a core even while idle (measured here: ~1 CPU-second per second), which on small
    # machines is the core the computation needs. Pass rpc_backend_options to choose.
    options = config.rpc_backend_options or _rpc.TensorPipeRpcBackendOptions(
        _transports=["uv"], rpc_timeout=watchdog.current_timeout())
    options.init_method = f"{_SCHEME}://{token}"
    store = None if w.world_size == 1 else _default_store()
    pins = loopback_pins(launch_env.detect().master_addr or launch_env.LOOPBACK)
    timeout = store.timeout if store is not None else None
    try:
        with _scoped_env(pins), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SPURIOUS, category=UserWarning)
            _rpc.init_rpc(worker_name(w.rank), backend=config.rpc_backend, rank=w.rank,
                          world_size=w.world_size, rpc_backend_options=options)
    finally:
        if store is not None:
            store.set_timeout(timeout)  # init_rpc set RPC's timeout on the shared store
    if store is not None:
        global _liveness
        detected = launch_env.detect()
        _liveness = rpc_liveness.start(
            dist.PrefixStore(f"metadist/rpc/{token}/live", store),  # type: ignore[attr-defined]
            detected.master_addr, detected.master_port, w.rank, w.world_size)


def stop() -> None:
    """Wait for every worker to reach the shutdown while it is alive, then stop RPC
    (collective) within the job's limit; a worker that stopped answering is named."""
    global _liveness
    limit = watchdog.current_timeout()
    me = worker_name(_world.world().rank)
    live, _liveness = _liveness, None
    if live is not None:
        try:
            live.wait_all_arrived(limit)
        except (rpc_liveness.SilentWorkersError, StoreLostError) as exc:
            with contextlib.suppress(Exception):
                _rpc.shutdown(graceful=False)
            why = (f"{', '.join(worker_name(r) for r in exc.ranks)} sent no heartbeat for "
                   f"{limit:g} s and never reached it: stopped (SIGSTOP, a debugger), frozen, "
                   "dead or cut off by the network"
                   if isinstance(exc, rpc_liveness.SilentWorkersError)
                   else f"the job's store was lost ({exc})")
            raise MetadistError(f"the rpc engine's shutdown on {me} cannot complete: {why}. "
                                f"Raise {watchdog.TIMEOUT_VAR} if a worker is legitimately "
                                "silent longer") from exc
        finally:
            live.close()
    failed: list[BaseException] = []

    def graceful() -> None:
        try:
            _rpc.shutdown(graceful=True, timeout=limit)
        except BaseException as exc:  # reported below, on the calling thread
            failed.append(exc)

    worker = threading.Thread(target=graceful, name="metadist-rpc-shutdown", daemon=True)
    worker.start()
    worker.join(limit + _SHUTDOWN_MARGIN_S)
    if worker.is_alive():
        watchdog.report_and_exit(MetadistError.__name__, (
            f"the rpc engine's shutdown on {me} did not return within {limit:g} s plus "
            f"{_SHUTDOWN_MARGIN_S:g} s although every worker had reached it (torch's RPC "
            "stalled); this process is stopped"))
    if failed:
        with contextlib.suppress(Exception):
            _rpc.shutdown(graceful=False)
        first = str(failed[0]).strip().splitlines()
        raise MetadistError(
            f"the rpc engine's shutdown on {me} failed although every worker had reached it: "
            f"{first[0] if first else type(failed[0]).__name__}") from failed[0]


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
    return inner_function(func)(*args, **kwargs)


def execute(func: Callable[..., Any], parts: list[Part],
            reducer: Callable[[list[Any]], Any] | None,
            timeout: float | None) -> torch.futures.Future[Any]:
    """Send each part to its worker; a future of the results in part order (or reduced).
    Gradients of what several parts share come back summed in part order (rpc_shared)."""
    parts = rpc_shared.in_call_order(parts)
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


__all__ = ["AVAILABLE", "execute", "loopback_pins", "prepare", "start", "stop"]
