"""Store operations that cannot wait forever, and what an unanswered one means.

The rendezvous store lives in one process (rank 0's worker under ``metadist run``,
``launch``, mpirun and srun; torch's agent otherwise). A TCP client waiting for its reply
blocks in ``recv`` with no limit when that process is stopped (SIGSTOP, a debugger), frozen,
or cut off by the network, and the watchdog that should report the hang would wait behind
it. So every operation runs on a thread of its own and the caller waits at most a deadline;
an operation still unanswered then means the store is lost, and a probe of its address says
how: a listener that accepts connections but does not answer (the process is stopped or
frozen), nothing listening (it exited), or no answer to a connection at all (a network
partition, or the host is down).
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

REPLY_S = 5.0
"""Seconds a store operation may take (a healthy store answers in milliseconds)."""
PROBE_S = 2.0
"""Seconds a probe connection to a silent store may take."""


class StoreLostError(Exception):
    """The store did not answer in time (or its connection failed); ``str()`` says how."""


class BoundedStore:
    """Calls ``fn(store)`` on one worker thread, each waited for at most ``reply_s``."""

    def __init__(self, store: Any, host: str | None, port: int | None,
                 reply_s: float = REPLY_S) -> None:
        self._store, self.host, self.port, self.reply_s = store, host, port, reply_s
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="metadist-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(store)``; raises :class:`StoreLostError` when it fails to connect or is not
        answered within the deadline (then the worker thread may stay blocked in it: the
        next call waits behind it and is lost too)."""
        done = threading.Event()
        box: list[Any] = []

        def job() -> None:
            try:
                box.append(("ok", fn(self._store)))
            except BaseException as exc:  # the caller decides; the worker must not die
                box.append(("error", exc))
            finally:
                done.set()

        self._jobs.put(job)
        if not done.wait(self.reply_s):
            raise StoreLostError(self.diagnose(f"no answer within {self.reply_s:g} s"))
        kind, value = box[0]
        if kind == "error":
            raise StoreLostError(f"{type(value).__name__}: {_first_line(value)}") from value
        result: T = value
        return result

    def diagnose(self, what: str) -> str:
        """Why the store at ``host:port`` did not answer: ``what`` plus a probe's finding."""
        if self.host is None or self.port is None:
            return (f"{what}: the process hosting the store is stopped, frozen, gone or "
                    "unreachable")
        where = f"{self.host}:{self.port}"
        try:
            with socket.create_connection((self.host, self.port), timeout=PROBE_S):
                pass
        except ConnectionRefusedError:
            return (f"{what}; nothing listens at {where} any more: the process that hosted "
                    "the store has exited")
        except TimeoutError:
            return (f"{what}; {where} is unreachable (a connection attempt got no answer "
                    f"within {PROBE_S:g} s): a network partition, or the host is down")
        except OSError as exc:
            return (f"{what}; {where} is unreachable ({exc.strerror or exc}): a network "
                    "partition, or the host is down")
        return (f"{what}; {where} still accepts connections but does not answer: the process "
                "hosting the store is stopped (SIGSTOP, a debugger) or frozen")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
