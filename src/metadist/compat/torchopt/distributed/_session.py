"""The session behind the TorchOpt layer: which engine, the workers' names, and RPC kept up
until the interpreter exits.

Engine. metadist's own map-reduce API defaults to the ``"spmd"`` engine (every rank runs the
program). TorchOpt has one model only: rank 0 drives under ``@rank_zero_only`` while the other
ranks return from the entry function at once and serve the calls sent to them until RPC shuts
down at exit. Under spmd those ranks would never make the calls, so this layer starts the
``"rpc"`` engine unless told otherwise: ``engine=`` of :func:`~.world.auto_init_rpc`, else
``$METADIST_MAPREDUCE_ENGINE``, else ``"rpc"``. A session already running (one started by
:func:`metadist.mapreduce.init`, say) is used as it is. metadist-style programs keep spmd.

Shutdown. As in TorchOpt, RPC stays up after the decorated function returns and stops at
interpreter exit, gracefully: every rank waits there for all the others, so ranks that only
serve keep answering until the driver is done.

``__main__``. Functions travel by reference. ``metadist run`` runs the script through runpy,
which puts the launcher's ``__main__`` back as soon as the script ends, while a serving rank
still answers calls of the script's functions. So those calls travel as
:class:`ScriptFunction`, found in the script module this rank captured when the session
started; and the exit hook makes that module ``__main__`` again while it waits, for objects of
the script's classes. (Such an object arriving in the moment between the script's end and the
exit hook would not be found: define classes you send in an importable module.)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from metadist.errors import MetadistError
from metadist.mapreduce import rpc as mr_rpc
from metadist.mapreduce import session as mr_session
from metadist.mapreduce import world as mr_world
from metadist.mapreduce.functions import inner_function
from metadist.runtime import failures

DEFAULT_ENGINE = "rpc"


def default_worker_name_format(world_rank: int, world_size: int, local_rank: int,
                               local_world_size: int) -> str:
    """TorchOpt's worker names: the rank zero-padded to the width of the world size
    (``worker03`` of 12 workers), so that names sort in rank order."""
    del local_rank, local_world_size  # the name does not depend on the node layout
    return "worker" + str(world_rank).zfill(len(str(world_size)))


_lock = threading.Lock()
_name_format: Callable[..., str] = default_worker_name_format
_script: ModuleType | None = None  # this rank's __main__ when the session started
_exit_hook = False


def set_name_format(fmt: Callable[..., str]) -> None:
    """Name workers with ``fmt(world_rank=, world_size=, local_rank=, local_world_size=)``
    from the next session on."""
    global _name_format
    with _lock:
        _name_format = fmt


def name_format() -> Callable[..., str]:
    """The worker name format in force for this layer."""
    return _name_format


def running() -> bool:
    """Whether a map-reduce session (of this layer or metadist's own) is running."""
    return mr_session._session is not None


def worker_name(rank: int) -> str:
    """Name of global rank ``rank``: the running session's (RPC's own names), else the name
    this layer's format gives."""
    if running():
        return mr_world.worker_name(rank)
    info = mr_world.get_world_info()
    local = info.local_world_size
    return _name_format(world_rank=rank, world_size=info.world_size,
                        local_rank=rank % local, local_world_size=local)


def _agent_set() -> bool:
    if not mr_rpc.AVAILABLE:
        return False
    from torch.distributed import rpc

    return bool(rpc.api._is_current_rpc_agent_set())  # type: ignore[attr-defined]


def start(engine: str | None = None, *, backend: Any = None,
          rpc_backend_options: Any = None) -> mr_session.SessionConfig:
    """Start this layer's session (collective), or return the running session's
    configuration. The engine: ``engine``, else ``$METADIST_MAPREDUCE_ENGINE``, else rpc."""
    global _script
    with mr_session._lock:
        if mr_session._session is not None:
            return mr_session.config()
        if _agent_set():
            raise MetadistError(
                "torch.distributed.rpc was started outside metadist (init_rpc); metadist starts "
                "RPC itself: decorate the entry function with @todist.auto_init_rpc() (or call "
                "metadist.mapreduce.init('rpc')) instead of calling rpc.init_rpc")
        if engine is None and not os.environ.get(mr_session.ENGINE_ENV):
            engine = DEFAULT_ENGINE
        _script = sys.modules.get("__main__")
        config = mr_session.init(engine, worker_name_format=_name_format, backend=backend,
                                 rpc_backend_options=rpc_backend_options)
    _register_exit()
    return config


def _register_exit() -> None:
    # Registered after metadist.init registered its own hooks, so this one runs first (LIFO):
    # RPC stops before the process group goes.
    global _exit_hook
    with _lock:
        if not _exit_hook:
            atexit.register(_shutdown_at_exit)
            _exit_hook = True


@contextlib.contextmanager
def _as_main(script: ModuleType | None) -> Iterator[None]:
    """The script module as ``__main__`` for the duration (see the module notes)."""
    current = sys.modules.get("__main__")
    if script is None or current is script:
        yield
        return
    sys.modules["__main__"] = script
    try:
        yield
    finally:
        if current is not None:
            sys.modules["__main__"] = current


def _shutdown_at_exit() -> None:
    """TorchOpt's exit: stop RPC gracefully, each rank waiting for every other one."""
    failed = getattr(sys, "last_value", None) is not None or failures.failed_here()
    with _as_main(_script):
        if mr_session.engine_is_rpc() and not _agent_set():
            return  # the program called torch.distributed.rpc.shutdown() itself
        if failed:
            # Release the ranks waiting in RPC's shutdown but stay in the job: after an error
            # metadist's own exit hooks leave that to the watchdog's report.
            if mr_session.engine_is_rpc():
                mr_rpc.stop()
            return
        mr_session.shutdown()


def _lookup(module: ModuleType, qualname: str) -> Any:
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


class ScriptFunction:
    """A function of the running script, sent by name and found in the script module of the
    receiving rank (captured at start), whatever ``__main__`` is by the time it arrives."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = _script if _script is not None else sys.modules["__main__"]
        try:
            target = _lookup(module, self.qualname)
        except AttributeError:
            raise AttributeError(
                f"the script's function {self.qualname} is not defined on this rank; define it "
                "at module level of the script every rank runs") from None
        return inner_function(target)(*args, **kwargs)

    def __reduce__(self) -> tuple[type[ScriptFunction], tuple[str]]:
        return ScriptFunction, (self.qualname,)

    def __repr__(self) -> str:
        return f"ScriptFunction({self.qualname!r})"


def sendable(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as it should travel over RPC: by name when it is a module-level function of
    the script (``__main__``), otherwise as it is (pickled by reference)."""
    script = _script
    qualname = getattr(func, "__qualname__", "")
    if (script is None or getattr(func, "__module__", None) != "__main__"
            or "<locals>" in qualname):
        return func
    try:
        found = _lookup(script, qualname)
    except AttributeError:
        return func
    return ScriptFunction(qualname) if found is func else func


__all__ = ["DEFAULT_ENGINE", "ScriptFunction", "default_worker_name_format", "name_format",
           "running", "sendable", "set_name_format", "start", "worker_name"]
