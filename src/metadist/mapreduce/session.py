"""One map-reduce session per process: which engine runs the calls, start and stop.

Engines (one option, ``engine=`` or ``METADIST_MAPREDUCE_ENGINE``):

``"spmd"`` (default)
    Every rank runs the program. A call's parts are assigned to ranks, each rank computes its
    own and the results are combined with collectives on metadist's process group; gradients
    come back through the same collectives. Nothing is pickled but small results.
``"rpc"``
    torch.distributed.rpc with distributed autograd, the model of TorchOpt: typically rank 0
    drives and the others serve the calls sent to them.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from metadist.comm import ops
from metadist.mapreduce import world as mr_world
from metadist.runtime import world as _world

P = ParamSpec("P")
R = TypeVar("R")

ENGINES = ("spmd", "rpc")
ENGINE_ENV = "METADIST_MAPREDUCE_ENGINE"


@dataclass(frozen=True)
class SessionConfig:
    """How this process runs map-reduce calls (see :func:`init`)."""

    engine: str = "spmd"
    worker_name_format: mr_world.WorkerNameFormat = mr_world.DEFAULT_WORKER_NAME_FORMAT
    rpc_backend: Any = None  # torch.distributed.rpc.BackendType; None: TensorPipe
    rpc_backend_options: Any = None  # e.g. TensorPipeRpcBackendOptions (init_method is ours)


@dataclass
class _Session:
    config: SessionConfig
    owns_world: bool
    rpc_started: bool = False


_lock = threading.RLock()
_session: _Session | None = None


def choose_engine(requested: str | None) -> str:
    """``requested``, else ``$METADIST_MAPREDUCE_ENGINE``, else ``"spmd"``; validated."""
    name = requested if requested is not None else os.environ.get(ENGINE_ENV) or "spmd"
    match name:
        case "spmd" | "rpc":
            return name
        case _:
            where = "engine=" if requested is not None else f"{ENGINE_ENV}="
            raise ValueError(f"map-reduce engine {where}{name!r} is not known; choose one of: "
                             f"{', '.join(ENGINES)}")


def init(engine: str | None = None, *,
         worker_name_format: mr_world.WorkerNameFormat = mr_world.DEFAULT_WORKER_NAME_FORMAT,
         backend: Any = None, rpc_backend_options: Any = None) -> SessionConfig:
    """Join the job (:func:`metadist.init`) and start the chosen engine; collective.

    Calling it again switches the engine for later calls (every rank at the same point);
    RPC, once started, stays up until :func:`shutdown`. ``backend`` and
    ``rpc_backend_options`` are torch's RPC transport settings, as in TorchOpt.
    """
    global _session
    chosen = choose_engine(engine)
    config = SessionConfig(chosen, worker_name_format, backend, rpc_backend_options)
    with _lock:
        if _session is None:
            owns = not _world.is_initialized()
            _world.init()
            _session = _Session(config, owns)
        _session.config = config
        mr_world.set_worker_name_format(worker_name_format)
        if chosen == "rpc" and not _session.rpc_started:
            from metadist.mapreduce import rpc

            rpc.start(config)
            _session.rpc_started = True
    return config


def shutdown() -> None:
    """Stop RPC (gracefully: waits for every worker's pending calls) and, if this session
    joined the job, leave it. Collective under rpc; safe to call twice."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return
    if session.rpc_started:
        from metadist.mapreduce import rpc

        rpc.stop()
    if session.owns_world:
        _world.shutdown()


def config() -> SessionConfig:
    """The running session's configuration (the defaults before :func:`init`)."""
    session = _session
    return session.config if session is not None else SessionConfig(choose_engine(None))


def engine() -> str:
    """The engine that runs map-reduce calls now: ``"spmd"`` or ``"rpc"``."""
    return config().engine


def is_driver() -> bool:
    """Whether this process should run the training loop: every rank under spmd, rank 0
    under rpc (the other ranks serve the calls). Lets one script run on both engines."""
    return engine() == "spmd" or mr_world.get_world_rank() == 0


def ensure_started() -> SessionConfig:
    """The session's configuration, starting a default session on first use."""
    with _lock:
        if _session is None:
            return init()
        return _session.config


def barrier() -> None:
    """Block until every rank reaches this call."""
    ensure_started()
    ops.barrier()


def auto_init_rpc(worker_init_fn: Callable[[], None] | None = None,
                  worker_name_format: mr_world.WorkerNameFormat = (
                      mr_world.DEFAULT_WORKER_NAME_FORMAT),
                  *, engine: str | None = None, backend: Any = None,
                  rpc_backend_options: Any = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a program's entry function: start the session, run ``worker_init_fn`` on
    every rank between two barriers, run the function, then shut the session down.

    Under rpc the shutdown waits for every worker, so ranks that only serve calls stay
    available until the driver returns.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            init(engine, worker_name_format=worker_name_format, backend=backend,
                 rpc_backend_options=rpc_backend_options)
            ok = False
            try:
                barrier()
                if worker_init_fn is not None:
                    worker_init_fn()
                barrier()
                result = fn(*args, **kwargs)
                ok = True
                return result
            finally:
                # After a failure under spmd the other ranks may sit in a collective this rank
                # will never join: leave without the collective parts of shutdown. RPC's
                # graceful stop is kept, so serving ranks are released either way.
                if ok or engine_is_rpc():
                    shutdown()
                else:
                    _abandon()

        return wrapper

    return decorate


def engine_is_rpc() -> bool:
    session = _session
    return session is not None and session.rpc_started


def _abandon() -> None:
    global _session
    with _lock:
        session, _session = _session, None
    if session is not None and session.owns_world:
        _world.shutdown()


__all__ = ["ENGINES", "ENGINE_ENV", "SessionConfig", "auto_init_rpc", "barrier", "choose_engine",
           "config", "engine", "ensure_started", "init", "is_driver", "shutdown"]
