"""In-process spawn: run a function on N local ranks, return their results in rank order.

A failing rank is reported by the parent, with its number and traceback, as soon as its
message arrives; the other ranks (often blocked in a collective with the dead one) are killed.
Errors the others hit *because* of that failure (a peer's connection closed, the watchdog
stopping them) are secondary: the error names the origin rank and lists them in one line each.
A rank that hangs past the timeout has its Python stack dumped (faulthandler) before it is
killed, and the error names it. Children die with the parent (``PR_SET_PDEATHSIG`` on Linux
plus a watchdog), so no process outlives a crashed or interrupted caller.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from metadist.errors import LaunchTimeoutError, MetadistError, RankFailedError
from metadist.runtime import failures, rank_start
from metadist.runtime.env import LOOPBACK

# After the origin's failure, how long to collect the other ranks' (secondary) errors, and how
# long to wait for an origin when only secondary errors have arrived so far.
_GRACE_S = 1.0
_ORIGIN_WAIT_S = 3.0
# After a timeout, how long to wait for the report of a rank that did not arrive: its watchdog
# sees the abort on its next tick and waits for the reporter (at most ~6 s) before it reports
# and exits, and its exit ends the wait at once. A rank that cannot run (stopped: SIGSTOP, a
# debugger) is not waited for at all.
_HUNG_WAIT_S = 10.0
# How long a stuck rank's dump thread may take to write its stacks (a loaded machine can be
# slow to schedule it; a rank that answers ends the wait at once).
_DUMP_WAIT_S = 20.0


def _is_stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it cannot report."""
    return rank_start.process_state(pid) in ("T", "t")


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Spec:
    rank: int
    world_size: int
    local_world_size: int
    port: int
    backend: str | None
    collective_timeout: float | None
    startup_timeout: float  # the rendezvous: process start-up skew is not a hang
    threads: int
    parent_pid: int
    stack_file: str
    env: dict[str, str]  # the caller's at launch (a forked rank has the server's)


def _send(conn: Connection, obj: Any) -> None:
    """Pickle by value. multiprocessing's own pickler would move CPU tensors into shared
    memory, silently aliasing one tensor across ranks (and with the caller)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _describe(exc: BaseException) -> tuple[str, str, str, str, bool]:
    return ("error", type(exc).__name__, str(exc), traceback.format_exc(),
            failures.is_secondary(exc))


def _is_secondary(message: tuple[Any, ...]) -> bool:
    return len(message) > 4 and bool(message[4])


def _stuck(message: tuple[Any, ...]) -> tuple[int, ...]:
    """The ranks a watchdog's timeout report says did not arrive."""
    return tuple(message[5]) if len(message) > 5 and message[5] else ()


def _serve_stack_dumps(dumps: Connection, stack_out: Any) -> None:
    """On each request, write every thread's stack to ``stack_out`` and say so: the parent
    waits for that answer instead of guessing how long a signal-driven dump takes."""
    def serve() -> None:
        while True:
            try:
                dumps.recv_bytes()
                faulthandler.dump_traceback(file=stack_out, all_threads=True)
                stack_out.flush()
                dumps.send_bytes(b"dumped")
            except (EOFError, OSError):
                return

    threading.Thread(target=serve, name="metadist-stack-dump", daemon=True).start()


def _worker(spec: _Spec, conn: Connection, dumps: Connection,
            stdio: tuple[Any, Any] | None) -> None:
    """Child entry: join the process group, then run jobs sent by the parent until told to stop."""
    rank_start.die_with_caller(spec.parent_pid)
    rank_start.caller_environment(spec.env)
    rank_start.take_stdio(stdio)
    with open(spec.stack_file, "w") as stack_out:
        # The signal is the fallback for a rank whose threads cannot run (one holds the GIL).
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        _serve_stack_dumps(dumps, stack_out)
        for key in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
            del os.environ[key]
        node = spec.rank // spec.local_world_size
        os.environ.update(
            RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size),
            LOCAL_RANK=str(spec.rank % spec.local_world_size),
            LOCAL_WORLD_SIZE=str(spec.local_world_size), GROUP_RANK=str(node),
            GROUP_WORLD_SIZE=str(spec.world_size // spec.local_world_size),
            MASTER_ADDR=LOOPBACK, MASTER_PORT=str(spec.port), METADIST_LAUNCHER="launch",
        )
        import torch

        from metadist.runtime import line_output, watchdog, world

        line_output.install(spec.rank)  # ranks share the parent's terminal: whole lines
        torch.set_num_threads(spec.threads)
        world.forget_inherited()
        lock = threading.Lock()  # the watchdog thread may report while a reply is being sent

        def send(obj: Any) -> None:
            with lock:
                _send(conn, obj)

        # The watchdog's report reaches the parent before the watchdog exits the process.
        watchdog.set_reporter(lambda r: send(("error", r.exc_type, r.message, r.stack,
                                              r.secondary, r.stuck)))
        try:
            world.init(spec.backend, timeout=spec.collective_timeout,
                       rendezvous_timeout=spec.startup_timeout)
            send(("ready", None))
        except BaseException as exc:
            send(_describe(exc))
            return
        while True:
            try:
                message = _recv(conn)
            except (EOFError, OSError):
                break
            if message[0] == "stop":
                break
            _, fn, args, kwargs = message
            try:
                reply: tuple[Any, ...] = ("ok", fn(*args, **kwargs))
            except BaseException as exc:
                reply = _describe(exc)
            try:
                send(reply)
            except Exception as exc:  # e.g. an unpicklable return value
                send(("error", type(exc).__name__,
                      f"the return value of rank {spec.rank} could not be sent back: {exc}",
                      traceback.format_exc(), False))
        world.shutdown()


class RankPool:
    """N long-lived local ranks that have joined one process group and run jobs on request.

    ``launch`` uses a pool for one job; test suites keep pools alive across many jobs to pay
    the process start-up once. A job that fails or hangs closes the pool.
    """

    def __init__(self, nprocs: int, *, backend: str | None = None, nnodes: int = 1,
                 timeout: float = 300.0, start_method: str | None = None,
                 threads: int | None = None, fn_hint: Callable[..., Any] | None = None,
                 collective_timeout: float | None = None) -> None:
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        if nnodes < 1 or nprocs % nnodes:
            raise ValueError(f"nprocs ({nprocs}) must be a multiple of nnodes ({nnodes})")
        method = rank_start.start_method(fn_hint, start_method)
        if method == "fork":
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                raise MetadistError("cannot fork ranks from a process that already joined a "
                                    "process group; call metadist.shutdown() first or use spawn")
        self.nprocs = nprocs
        self.timeout = timeout
        ctx: Any = mp.get_context(method)
        port = free_port()
        threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        self._stack_dir = tempfile.TemporaryDirectory(prefix="metadist-stacks-")
        self._conns: list[Connection] = []
        self._dumps: list[Connection] = []  # stack-dump requests, answered by a thread
        self._procs: list[Any] = []
        self._closed = False
        for rank in range(nprocs):
            spec = _Spec(rank, nprocs, nprocs // nnodes, port, backend, collective_timeout,
                         timeout, threads, os.getpid(),
                         os.path.join(self._stack_dir.name, f"rank{rank}.txt"), dict(os.environ))
            parent_end, child_end = ctx.Pipe(duplex=True)
            dump_end, dump_child = ctx.Pipe(duplex=True)
            stdio = rank_start.CallerStdio() if method == "forkserver" else None
            proc = ctx.Process(target=_worker, args=(spec, child_end, dump_child, stdio),
                               name=f"metadist-rank{rank}")
            proc.start()
            child_end.close()
            dump_child.close()
            self._conns.append(parent_end)
            self._dumps.append(dump_end)
            self._procs.append(proc)
        self._collect("ready", timeout)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once the pool was closed, or a rank of it died between jobs (the pool is then
        closed: its process group is broken)."""
        if not self._closed and any(not p.is_alive() for p in self._procs):
            self.close(force=True)
        return self._closed

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self.closed:
            raise MetadistError("this RankPool was closed (a job failed, a rank died or it was "
                                "shut down); create a new one")
        for conn in self._conns:
            _send(conn, ("run", fn, tuple(args), dict(kwargs or {})))
        return self._collect("ok", self.timeout if timeout is None else timeout)

    def _collect(self, expected: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.nprocs
        pending = set(range(self.nprocs))
        failed: list[tuple[int, tuple[Any, ...]]] = []
        first_failure = 0.0
        while pending:
            limit = deadline
            if failed:
                origin_known = any(not _is_secondary(m) for _, m in failed)
                absent = {r for _, m in failed for r in _stuck(m)}
                awaited = {r for r in absent & pending if not _is_stopped(self._procs[r].pid)}
                wait_s = (_HUNG_WAIT_S if awaited else _GRACE_S if origin_known
                          else _ORIGIN_WAIT_S)
                limit = min(deadline, first_failure + wait_s)
            waitables: list[Any] = [self._conns[r] for r in pending]
            waitables += [self._procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                if failed:
                    break
                self._timeout(sorted(pending), timeout)
            for rank in sorted(pending):
                message = self._receive(rank, ready)
                if message is None:
                    continue
                pending.discard(rank)
                if message[0] == expected:
                    results[rank] = message[1]
                else:
                    failed.append((rank, message))
                    first_failure = first_failure or time.monotonic()
        if failed:
            stopped = {r for r in pending if _is_stopped(self._procs[r].pid)}
            self.close(force=True)
            # The origin is the first failure that is not a consequence of another one.
            rank, (_, exc_type, text, tb, *extra) = next(
                (f for f in failed if not _is_secondary(f[1])), failed[0])
            others = {r: failures.one_line(m[1], m[2]) for r, m in failed if r != rank}
            # Ranks that had not reported when the grace period ended are stopped here: most
            # likely blocked in a collective with the origin. They are listed all the same.
            others.update({r: f"stopped by launch() after rank {rank} failed ("
                              + ("it was stopped itself (SIGSTOP, a debugger) and could not "
                                 "report)" if r in stopped else
                                 "it had not finished; most likely it was waiting for it in a "
                                 "collective)")
                           for r in pending})
            # A timeout's origin is the rank(s) that did not arrive, not the one that waited;
            # one that finished meanwhile never made the call.
            hung = _stuck(("error", exc_type, text, tb, *extra))
            others.update({r: "it returned from the function without making that call"
                           for r in hung if r not in others and r not in pending})
            raise RankFailedError(rank, exc_type, text, tb, others, hung=hung)
        return results

    def _receive(self, rank: int, ready: list[Any]) -> tuple[Any, ...] | None:
        conn, proc = self._conns[rank], self._procs[rank]
        if conn in ready or conn.poll():
            try:
                message: tuple[Any, ...] = _recv(conn)
                return message
            except (EOFError, OSError):
                pass
        if proc.sentinel in ready or not proc.is_alive():
            proc.join(0.1)
            code = proc.exitcode
            how = (f"killed by signal {-code}" if code is not None and code < 0
                   else f"exit code {code}")
            text = f"rank {rank} exited unexpectedly ({how})"
            if code == -signal.SIGABRT:  # not killed: it aborted itself, and said why
                text = f"rank {rank} aborted (signal SIGABRT): {failures.ABORTED}"
            return ("error", "ProcessExited", text, "", False)
        return None

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every rank's Python stacks: asked of its dump thread and awaited (at most
        ``_DUMP_WAIT_S``), else by SIGUSR1 (faulthandler) for a rank whose threads cannot run."""
        asked: dict[Connection, int] = {}
        for rank in ranks:
            with contextlib.suppress(OSError):
                self._dumps[rank].send_bytes(b"dump")
                asked[self._dumps[rank]] = rank
        deadline = time.monotonic() + _DUMP_WAIT_S
        while asked and time.monotonic() < deadline:
            ready = wait(list(asked), timeout=max(0.0, deadline - time.monotonic()))
            for conn in [c for c in asked if c in ready]:
                with contextlib.suppress(EOFError, OSError):
                    conn.recv_bytes()
                del asked[conn]
        silent = sorted(asked.values())
        for rank in silent:
            pid = self._procs[rank].pid
            if pid is not None and self._procs[rank].is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        if silent:
            time.sleep(0.5)  # faulthandler writes from the signal handler: no answer to await
        stacks = {}
        for rank in ranks:
            try:
                with open(os.path.join(self._stack_dir.name, f"rank{rank}.txt")) as f:
                    stacks[rank] = f.read()
            except OSError:
                stacks[rank] = ""
        return stacks

    def _timeout(self, ranks: list[int], timeout: float) -> NoReturn:
        stacks = self._dump_stacks(ranks)
        self.close(force=True)
        raise LaunchTimeoutError(ranks, timeout, stacks)

    def close(self, force: bool = False) -> None:
        """Stop every rank; ``force`` kills without asking them to leave the group."""
        if self._closed:
            return
        self._closed = True
        if not force:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    _send(conn, ("stop",))
            for proc in self._procs:
                proc.join(10.0)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in (*self._conns, *self._dumps):
            conn.close()
        self._stack_dir.cleanup()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close(force=True)


def launch(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (),
           kwargs: dict[str, Any] | None = None, *, backend: str | None = None,
           timeout: float = 300.0, nnodes: int = 1, start_method: str | None = None,
           threads: int | None = None, collective_timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return results in rank order.

    Each rank calls :func:`metadist.init` first, on a free loopback port. ``nnodes`` splits
    the ranks into simulated nodes (node-local and cross-node groups behave as on a cluster).
    ``threads`` sets torch's intra-op threads per rank (default: cores / nprocs).
    ``start_method`` is multiprocessing's (default: forked from a server that imported
    metadist once on Linux, see :mod:`metadist.runtime.rank_start`; else ``"spawn"``).
    ``timeout`` bounds the whole call; ``collective_timeout`` is each rank's
    ``init(timeout=...)``: how long one collective may wait (default ``$METADIST_TIMEOUT``,
    else 300 s) before every rank stops with an error naming the op and the missing ranks.

    Raises:
        RankFailedError: a rank failed; it names the origin rank (not the ranks that failed
            as a consequence, listed in one line each) and carries its traceback.
        LaunchTimeoutError: ranks were still running after ``timeout`` seconds.
    """
    with RankPool(nprocs, backend=backend, nnodes=nnodes, timeout=timeout,
                  start_method=start_method, threads=threads, fn_hint=fn,
                  collective_timeout=collective_timeout) as pool:
        return pool.run(fn, args, kwargs, timeout)
