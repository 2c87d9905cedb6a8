"""The per-process watchdog: no collective waits forever, and a stuck one is explained.

A daemon thread wakes every ``tick`` seconds and looks at the tracker (``runtime/tracker.py``):

1. A collective waiting longer than ``grace`` makes it publish this rank's progress (last
   sequence number and op per group) to the store, so a stalled job can be diagnosed while
   a healthy one never touches the store per collective.
2. A collective waiting longer than ``timeout`` makes this rank the reporter (the first to
   claim the store's ``abort`` key): it waits a moment for the others to publish, reads every
   member's progress, names the ranks that did not arrive (or entered a different op), prints
   one report with its stack, and exits the process with status :data:`EXIT_CODE`.
3. A rank that is waiting too, or has entered no collective for ``timeout / 2`` (the one hung
   in user code), polls the ``abort`` key: when another rank reports, it publishes its own
   progress, waits until the reporter has read it, prints one line (where it was, e.g. the
   line of user code it hung in) and exits with the same status. A healthy rank never polls.

Exiting with ``os._exit`` is deliberate: a thread blocked inside gloo or NCCL cannot be
interrupted, and a launcher (``metadist run``, mpirun, srun, ``metadist.launch``) tears the
job down as soon as one process exits non-zero.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from metadist.errors import CollectiveFailedError, CollectiveTimeoutError, MetadistError
from metadist.runtime import failures
from metadist.runtime.progress import AbortRecord, Progress, explain
from metadist.runtime.tracker import TRACKER, CollectiveCall

DEFAULT_TIMEOUT_S = 300.0
"""Default seconds a collective (and the rendezvous in ``init``) may wait."""
EXIT_CODE = 124
"""Exit status of a process stopped by the watchdog (that of coreutils' ``timeout``)."""
TIMEOUT_VAR = "METADIST_TIMEOUT"


def resolve_timeout(value: float | datetime.timedelta | None) -> float:
    """Seconds from ``init(timeout=...)``, else ``$METADIST_TIMEOUT``, else 300."""
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    source = "timeout"
    if value is None:
        raw = os.environ.get(TIMEOUT_VAR, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        source = f"{TIMEOUT_VAR}={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{source} is not a number of seconds; set e.g. "
                             f"{TIMEOUT_VAR}=600 or unset it for the default "
                             f"({DEFAULT_TIMEOUT_S:.0f} s)") from None
    if not value > 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {value}")
    return float(value)


def backstop(timeout: float) -> float:
    """The process group's own timeout: later than the watchdog's, so the watchdog's
    message wins and torch's only fires if the watchdog could not run."""
    return timeout + max(10.0, timeout / 2)


@dataclass(frozen=True)
class WatchdogConfig:
    """How long collectives may wait and how closely the watchdog looks."""

    timeout: float  # seconds before every rank is stopped
    tick: float  # seconds between looks
    grace: float  # a collective waiting this long publishes this rank's progress
    exit_code: int = EXIT_CODE

    @classmethod
    def for_timeout(cls, timeout: float) -> WatchdogConfig:
        tick = min(1.0, max(0.05, timeout / 20))
        return cls(timeout, tick, min(2.0, max(2 * tick, timeout / 10)))


@dataclass(frozen=True)
class Report:
    """What the watchdog says before it exits the process."""

    exc_type: str
    message: str
    stack: str  # where this rank's training thread was
    secondary: bool
    stuck: tuple[int, ...] = ()  # the ranks that did not arrive (the hang's origin)


def _print_and_record(report: Report) -> None:
    rank = failures.rank_label()
    text = f"[rank {rank}] metadist watchdog: {report.message}\n"
    if not report.secondary and report.stack:
        text += f"--- where rank {rank} was ---\n{report.stack}"
    os.write(2, text.encode(errors="replace"))
    failures.write_error_file(failures.one_line(report.exc_type, report.message),
                              report.message + "\n" + report.stack,
                              secondary=report.secondary, printed=True, stuck=report.stuck)


_reporter: Callable[[Report], None] = _print_and_record
_MACHINERY = tuple(os.path.join(os.path.dirname(os.path.dirname(__file__)), d) + os.sep
                   for d in ("comm", "runtime"))
_BOOTSTRAP = (*_MACHINERY, "<", os.path.dirname(threading.__file__) + os.sep + "multiprocessing")
# Python's own library: a rank blocked in ``Event.wait`` is better placed by its caller.
_STDLIB = (sysconfig.get_paths()["stdlib"] + os.sep,)


def set_reporter(reporter: Callable[[Report], None] | None) -> None:
    """Where reports go before the process exits (``launch`` sends them to the parent);
    ``None`` restores the default (stderr, plus torch elastic's error file)."""
    global _reporter
    _reporter = reporter or _print_and_record


def report_and_exit(exc_type: str, message: str, exit_code: int = EXIT_CODE) -> None:
    """Report ``message`` as the watchdog would (stderr and the error file, or the parent
    under ``launch``), then exit the process: for a thread that cannot be interrupted."""
    try:
        _reporter(Report(exc_type, message, "", False))
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(exit_code)


def _seconds(t: float) -> str:
    return f"{t:g} s"


class Watchdog:
    """The thread described in the module docstring, for one process group lifetime."""

    def __init__(self, config: WatchdogConfig, rank: int, progress: Progress) -> None:
        self.config = config
        self.rank = rank
        self.progress = progress
        self._stop = threading.Event()
        self._published: dict[str, int] = {}
        self._training_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._loop, name="metadist-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.tick):
            with contextlib.suppress(Exception):  # the watchdog itself must never die
                self._look()

    def _look(self) -> None:
        now = time.monotonic()
        waiting = TRACKER.waiting()
        # A rank blocked in a collective starts and finishes no other: if it still does, the
        # oldest entry is not what it waits on (an entry left behind must not stop a healthy
        # job), so a wait counts only from the rank's last collective activity.
        age = (min(now - waiting[0].start, now - TRACKER.last_active) if waiting else 0.0)
        if age >= self.config.grace:
            self.publish()
        # Ask the store whether another rank is reporting only while waiting, or after a long
        # time without collectives (the rank that hangs in user code): a healthy job never
        # asks, so ranks that outlive rank 0 (whose process hosts the store under launch,
        # mpirun and srun) do not knock on a closed store.
        if age >= self.config.grace or (not waiting and now - TRACKER.last_active
                                        >= self.config.timeout / 2):
            record = self.progress.abort_record()
            if record is not None and record.rank != self.rank:
                self._follow(record, waiting)
        if waiting and age >= self.config.timeout:
            self._expire(waiting[0], waiting)

    def publish(self, force: bool = False) -> None:
        """Put this rank's last collective per group in the store (when it changed)."""
        for group, seq, op, recent in TRACKER.progress():
            if force or self._published.get(group.name) != seq:
                self.progress.publish(group.name, self.rank, seq, op, recent[-2::-1])
                self._published[group.name] = seq

    def _stack(self) -> tuple[str, str]:
        """The training thread's stack, and its innermost frame as ``file:line in fn``."""
        frame = sys._current_frames().get(self._training_thread)
        if frame is None:
            return "", "an unknown place"
        summary = traceback.extract_stack(frame)
        # From the user's first frame (not the launcher's bootstrap) to the caller of the
        # collective (not the inside of comm).
        while len(summary) > 1 and summary[-1].filename.startswith(_MACHINERY):
            summary.pop()
        while len(summary) > 1 and summary[0].filename.startswith(_BOOTSTRAP):
            summary.pop(0)
        last = next((f for f in reversed(summary) if not f.filename.startswith(_STDLIB)),
                    summary[-1])
        where = f"{last.filename}:{last.lineno} in {last.name}"
        return "".join(traceback.format_list(summary)), where

    def _expire(self, entry: CollectiveCall, waiting: list[CollectiveCall]) -> None:
        mine = AbortRecord(self.rank, entry.group.name, entry.group.label, entry.seq, entry.op)
        standing = self.progress.claim_abort(mine)
        if standing is not None and standing != mine:
            self._follow(standing, waiting)  # another rank reports; _follow exits
            return
        self.publish(force=True)
        if self.progress.available:  # the others publish on their tick
            time.sleep(min(3.0, 3 * self.config.tick + 0.1))
        states = self.progress.read(entry.group.name, entry.group.ranks)
        text, stuck = explain(entry, states, self.rank, self.progress)
        self.progress.mark_reported()
        fix = ("Every rank must issue the same collectives in the same order; if a rank is "
               "legitimately slower here (e.g. it writes a checkpoint alone), raise the limit: "
               f"metadist.init(timeout=...) or {TIMEOUT_VAR}=<seconds>.")
        if entry.within is not None:
            fix = (f"It was issued by {entry.within}, which is collective: every rank must call "
                   "it (a call on some ranks only, e.g. under `if rank == 0:`, waits here for "
                   "the others); call it on every rank and keep the result where it is "
                   "needed. " + fix)
        message = (f"{entry.op} #{entry.seq} on {entry.group.label} did not complete within "
                   f"{_seconds(self.config.timeout)} on rank {self.rank}: {text}. {fix} "
                   f"Every rank is being stopped (exit status {self.config.exit_code}).")
        self._die(Report(CollectiveTimeoutError.__name__, message, self._stack()[0], False,
                         stuck), linger=0.3)

    def _follow(self, record: AbortRecord, waiting: list[CollectiveCall]) -> None:
        self.publish(force=True)
        stack, where = self._stack()
        if waiting:
            w = waiting[0]
            state = f"this rank was waiting in {w.op} #{w.seq} on {w.group.label}"
        else:
            state = f"this rank was not in a collective: it was at {where}"
        message = (f"rank {self.rank} stopped: rank {record.rank} reported that {record.op} "
                   f"#{record.seq} on {record.label} timed out; {state}")
        # Under launch, mpirun and srun the store lives in rank 0's process: stay until the
        # reporter has read everyone's progress.
        self.progress.wait_reported(limit=min(5.0, 4 * self.config.tick + 2.0))
        # Exit after the reporter, so a launcher sees the origin's own exit first.
        self._die(Report(CollectiveTimeoutError.__name__, message, stack, True), linger=0.5)

    def _die(self, report: Report, linger: float = 0.0) -> None:
        try:
            _reporter(report)
            # The reporter keeps the store up (it may host it) while the others, polling every
            # 50 ms, see that it has read their progress; they leave after it.
            time.sleep(linger)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(self.config.exit_code)


_active: Watchdog | None = None
_exit_hook = False


def start(config: WatchdogConfig, rank: int, progress: Progress) -> Watchdog:
    """Start the watchdog of this process (replacing a previous one)."""
    global _active
    stop()
    _active = Watchdog(config, rank, progress)
    _active.start()
    global _exit_hook
    if not _exit_hook:
        atexit.register(_leave_at_exit)
        _exit_hook = True
    return _active


# How long rank 0 waits at shutdown for the other ranks to leave (see leave()).
_LEAVE_WAIT_S = 10.0


def leave(others: tuple[int, ...] = ()) -> None:
    """This rank leaves the job cleanly: publish its last collectives and that it left, so a
    rank still waiting for it can say "rank 1 had already left after its #3 all_reduce"
    rather than only "did not arrive". With ``others`` (rank 0, whose process hosts the store
    under launch, mpirun and srun), wait for them to leave too (at most _LEAVE_WAIT_S): a
    rank publishing to a store that is gone makes torch print a C++ stack ("sendBytes
    failed ... Broken pipe") at the end of a successful job."""
    watchdog = _active
    if watchdog is not None and watchdog.progress.available:
        watchdog.publish(force=True)
        watchdog.progress.publish_left(watchdog.rank)
        if others:
            watchdog.progress.wait_left(others, _LEAVE_WAIT_S)


def _leave_at_exit() -> None:
    # A program that ends without metadist.shutdown() left too, unless it ended by an error
    # (an uncaught exception sets sys.last_value; metadist run's entry records its own).
    if getattr(sys, "last_value", None) is None and not failures.failed_here():
        leave()


def stop(*, leaving: bool = False, others: tuple[int, ...] = ()) -> None:
    """Stop the watchdog and forget every group's sequence numbers (``leaving``: this rank
    leaves the job, see :func:`leave`, waiting for ``others`` to leave too)."""
    global _active
    if leaving:
        leave(others)
    watchdog, _active = _active, None
    if watchdog is not None:
        watchdog.stop()
    TRACKER.reset()


def forget_inherited() -> None:
    """In a forked child: the parent's thread did not come along, drop its state."""
    global _active
    _active = None
    TRACKER.reset()


def active() -> Watchdog | None:
    return _active


def current_timeout() -> float:
    """The seconds this process's collectives may wait (its watchdog's limit, or what
    ``init`` would choose): the bound for other waits on peers too (rpc)."""
    return _active.config.timeout if _active is not None else resolve_timeout(None)


def claim_first_failure() -> bool:
    """True when this rank is the first of the job to fail (or nobody can tell)."""
    watchdog = _active
    return True if watchdog is None else watchdog.progress.claim_first_failure(watchdog.rank)


def failed(entry: CollectiveCall, exc: BaseException) -> BaseException:
    """The error to raise for ``exc`` thrown by the collective of ``entry``: a lost peer
    becomes a :class:`CollectiveFailedError` naming the op, its number and the ranks that did
    not arrive; other errors pass through unchanged."""
    TRACKER.discard(entry)
    watchdog = _active
    if isinstance(exc, MetadistError) or watchdog is None or not failures.is_peer_loss(exc):
        return exc
    # The surviving ranks hit the same error at the same moment: publish, give them a moment
    # to publish theirs, then see who is missing.
    watchdog.progress.publish(entry.group.name, watchdog.rank, entry.seq, entry.op)
    time.sleep(0.2)
    states = watchdog.progress.read(entry.group.name, entry.group.ranks)
    text, missing = explain(entry, states, watchdog.rank, watchdog.progress)
    left = bool(missing) and watchdog.progress.left(missing) == set(missing)
    # A peer that left cleanly did not fail: the programs diverged, and this rank's error is
    # the one to show (not secondary).
    why = ("Every rank must issue the same collectives in the same order; this error is the "
           "one to read" if left else
           "That rank most likely failed or was killed: its own error is the one to read")
    return CollectiveFailedError(
        f"{entry.op} #{entry.seq} on {entry.group.label} failed on rank {watchdog.rank}: a "
        f"peer's connection closed; {text}. {why}. "
        f"(backend: {failures.one_line(type(exc).__name__, str(exc))})",
        op=entry.op, seq=entry.seq, missing=missing, secondary=not left)
