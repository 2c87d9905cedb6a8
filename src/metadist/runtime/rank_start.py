"""How ``launch()`` starts its ranks, and how a rank stays bound to the program that started it.

[Note: ranks fork from a server that imported metadist once]
A spawned rank is a fresh interpreter that imports torch and metadist: seconds of CPU per rank,
paid again by every launch. On Linux ranks instead start from multiprocessing's forkserver with
metadist preloaded: a quiet process that imported them once and forks each rank from there, so
a rank is ready in milliseconds. A forked rank runs the caller's function as a spawned one would
(the caller's ``sys.path``, working directory and main module are prepared the same way), with
three things a fork would otherwise take from the server rather than the caller:

* the environment: each rank sets the caller's environment as it is at launch, before it
  imports anything else (:func:`caller_environment`);
* standard output and error: each rank writes to the caller's descriptors as they are at
  launch (a test's capture, a redirected log), passed along with the rank;
* the variables read only when a process or library starts (the dynamic loader's, glibc's,
  Python's, :data:`metadist.runtime.resident.ENV`): setting them in a forked rank is too late,
  so a launch whose values differ from the server's starts another server with them (the old
  one ends when the ranks it forked have).

The server lives as long as the caller (it holds no rank and no process group); ranks watch the
caller itself, since their parent is the server. A program that started multiprocessing's
forkserver itself keeps it as it is, and its ranks are spawned.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import forkserver, reduction
from typing import Any

from metadist.runtime import resident

_PRELOAD = ["metadist"]
# Read when a rank joins its process group or later, never when a process starts: a rank that
# sets them from the caller's environment behaves as if it had been spawned with them.
_READ_LATER_PREFIXES = ("METADIST_", "PYTEST_", "TORCHELASTIC_", "MASTER_", "GLOO_", "NCCL_",
                        "TORCH_NCCL_", "CUDA_")
_READ_LATER = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                         "GROUP_WORLD_SIZE"})
_READ_AT_IMPORT = frozenset({resident.ENV, "THP_MEM_ALLOC_ENABLE"})

_lock = threading.Lock()
# The server metadist started and the environment it started with; servers it stopped using.
_server: dict[str, Any] = {"configured": False, "pid": None, "env": None}
_retired: list[int] = []


def _read_later(key: str) -> bool:
    return key not in _READ_AT_IMPORT and (key in _READ_LATER
                                           or key.startswith(_READ_LATER_PREFIXES))


def _differs_at_start(env: dict[str, str], other: dict[str, str]) -> bool:
    keys = env.keys() | other.keys()
    return any(env.get(k) != other.get(k) for k in keys if not _read_later(k))


def _retire(server: Any) -> None:
    """Stop sending ranks to the running server: it exits once the ranks it forked have (they
    hold it), and a later :meth:`ensure_running` starts another."""
    _retired.append(server._forkserver_pid)
    os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def _reap_retired() -> None:
    for pid in list(_retired):
        try:
            done = os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            done = True
        if done:
            _retired.remove(pid)


def _forkserver_ready() -> bool:
    """Make the running server one that metadist started with the caller's start-up variables
    as they are now (starting one, or another where they changed or it was restarted out of
    metadist's sight); False where the program runs a server of its own."""
    server: Any = forkserver._forkserver  # private: read, and its preload set before it starts
    with _lock:
        _reap_retired()
        try:
            if not _server["configured"]:
                if server._forkserver_pid is not None:
                    return False  # the program's own: its preload and environment unknown
                server._preload_modules = list(dict.fromkeys([*server._preload_modules,
                                                              *_PRELOAD]))
                _server["configured"] = True
            if server._forkserver_pid is not None and not _alive(server._forkserver_pid):
                _retire(server)  # dead, perhaps reaped already (ensure_running would raise)
            before = server._forkserver_pid
            server.ensure_running()
            started = server._forkserver_pid != before  # just now, with the environment now
            if not started and (server._forkserver_pid != _server["pid"] or _differs_at_start(
                    dict(os.environ), _server["env"])):
                _retire(server)
                server.ensure_running()
                started = True
            if started:
                _server.update(pid=server._forkserver_pid, env=dict(os.environ))
        except (OSError, AttributeError):  # no server here, or a multiprocessing whose
            return False  # server keeps other state than the one read here: spawn
        return True


def start_method(fn: Callable[..., Any] | None, requested: str | None) -> str:
    """``requested``, else how this caller's ranks start best (see the module notes)."""
    if requested is not None:
        return requested
    main = sys.modules.get("__main__")
    if fn is not None and getattr(fn, "__module__", None) == "__main__" and not getattr(
        main, "__file__", None
    ):
        # Defined in a notebook or REPL: a spawned child cannot import it, a forked one has it.
        return "fork"
    if sys.platform.startswith("linux") and _forkserver_ready():
        return "forkserver"
    return "spawn"


def caller_environment(env: dict[str, str]) -> None:
    """Make this rank's environment the caller's ``env`` (a forked rank has the server's)."""
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)


class CallerStdio:
    """The caller's standard output and error as they are when a rank starts: pickled into
    the rank's arguments, they travel as descriptors (a forked rank has the server's)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, ((reduction.DupFd(1), reduction.DupFd(2)),))


def take_stdio(stdio: tuple[Any, Any] | None) -> None:
    """Write to the caller's standard output and error (what :class:`CallerStdio` became)."""
    if stdio is None:
        return
    for target, wrapped in zip((1, 2), stdio, strict=True):
        fd = wrapped.detach()
        os.dup2(fd, target)
        os.close(fd)


def process_state(pid: int | None) -> str | None:
    """Process ``pid``'s state letter from /proc (``R``, ``S``, ``T``, ``Z``, ...); None where
    it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    state = process_state(pid)
    if state is not None:
        return state not in ("Z", "X")
    try:  # no /proc: ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def die_with_caller(caller_pid: int) -> None:
    """End this rank when the program that launched it ends, however it ends.

    A spawned rank's parent is the caller: the kernel kills it when the caller exits
    (``PR_SET_PDEATHSIG``). A forked rank's parent is the server, which outlives the caller
    until its ranks exit; a thread watches the caller for both.
    """
    forker = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def gone() -> bool:
        return os.getppid() != forker or (forker != caller_pid and not _alive(caller_pid))

    def watch() -> None:
        while not gone():
            time.sleep(1.0)
        os._exit(1)

    if gone() or not _alive(caller_pid):
        os._exit(1)
    threading.Thread(target=watch, name="metadist-parent-watch", daemon=True).start()

