"""How a failure on one rank is shown once.

A rank that fails first is the *origin*; the errors other ranks then hit (a peer's
connection closed under a collective, the watchdog stopping them, the same mismatch seen by
every rank) are *secondary*. Secondary errors carry ``secondary = True`` or are recognised
by their transport message. ``metadist run`` workers print the origin's traceback once (the
first rank to fail claims it in the store) and a single line otherwise; they leave a
torch-elastic error file with a ``metadist`` block that :func:`summarize_run_failure` reads
to name the origin rank and list the others in one line each.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

# What gloo, NCCL and the store say when a peer process went away. Such an error is never
# the origin: the rank that went away is.
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "remote process exited",
    "communicator was aborted",
    "Failed to recv, got 0 bytes",
)


def is_peer_loss(exc: BaseException) -> bool:
    """The error says that another rank's process or connection disappeared."""
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in _PEER_LOSS)


def is_secondary(exc: BaseException) -> bool:
    """The error is a consequence of another rank's failure, not a failure of its own.
    An error that says so itself (metadist's own, with ``secondary``) is taken at its word:
    its message may quote a backend's peer-loss text while being the origin."""
    marked = getattr(exc, "secondary", None)
    return bool(marked) if marked is not None else is_peer_loss(exc)


def one_line(exc_type: str, message: str, limit: int = 400) -> str:
    """``"Type: first line of the message"``, cut to ``limit`` characters."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    text = f"{exc_type}: {first}" if first else exc_type
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rank_label() -> str:
    """This process's rank as a report names it: the launcher's ``RANK``, else the default
    process group's (one a program initialised itself with an explicit rank, as
    ``mp.spawn`` programs do), else "?"."""
    rank = os.environ.get("RANK")
    if rank is not None:
        return rank
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return "?"


def write_error_file(summary: str, detail: str, *, secondary: bool, printed: bool,
                     stuck: tuple[int, ...] = ()) -> None:
    """Leave torch elastic's error file (its JSON layout plus a ``metadist`` block); does
    nothing outside torchrun/``metadist run``. ``stuck``: the ranks a timed-out collective
    waited for (the hang's origin, though this rank reports it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": summary, "extraInfo": {
        "py_callstack": detail, "timestamp": str(int(now)),
        "metadist": {"secondary": secondary, "printed": printed, "time": now,
                     "stuck": list(stuck)}}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the launcher then reports the exit code alone


_failed_here = False


def failed_here() -> bool:
    """This process recorded a failure of its script (it does not leave the job cleanly)."""
    return _failed_here


def record_script_failure(exc: BaseException, claim_first: Callable[[], bool]) -> None:
    """A ``metadist run`` worker's script raised: print its traceback once across ranks (the
    first rank to fail, by ``claim_first``) or one line, and leave the error file."""
    global _failed_here
    _failed_here = True
    rank = rank_label()
    secondary = is_secondary(exc)
    origin = not secondary and claim_first()
    detail = "".join(traceback.format_exception(exc))
    summary = one_line(type(exc).__name__, str(exc))
    if origin:
        text = f"[rank {rank}] {detail}"
    else:
        why = ("a consequence of another rank's failure" if secondary
               else "another rank failed first")
        text = f"[rank {rank}] {summary} ({why}; traceback not repeated)\n"
    os.write(2, text.encode(errors="replace"))  # one write: ranks' reports never interleave
    write_error_file(summary, detail, secondary=not origin, printed=origin)


@dataclass(frozen=True)
class _Failed:
    rank: int
    how: str
    summary: str
    detail: str
    secondary: bool
    printed: bool
    when: float
    stuck: tuple[int, ...] = ()


# A process that aborts itself: C++ code (gloo, NCCL, torch) hit a failed check or an uncaught
# exception, printed why to the rank's stderr and called abort(). Nobody killed it.
ABORTED = ("no Python traceback: the process aborted in native code (a failed check in "
            "gloo, NCCL or torch, e.g. tensors of different sizes on different ranks in one "
            "collective). The reason is printed above in this rank's output, on a line such as "
            "\"terminate called after throwing an instance of ...\" followed by \"what(): ...\" "
            "(search for \"what()\" or \"Fatal Python error: Aborted\"); METADIST_DEBUG=1 "
            "compares every collective's shapes across ranks before running it")


def _read(rank: int, failure: Any, killed: Collection[int] = ()) -> _Failed:
    code = int(failure.exitcode)
    if getattr(failure, "pid", None) in killed:
        from metadist.runtime.teardown import GRACE_S

        return _Failed(rank, "killed by the launcher: SIGKILL",
                       f"stopped by the launcher: it did not end within {GRACE_S:g} s of "
                       "SIGTERM after another rank failed (a stopped or hung process ignores "
                       "SIGTERM)", "", True, False, float(failure.timestamp))
    if code == -signal.SIGABRT:
        how = "aborted itself: signal SIGABRT"
    elif code < 0:
        try:
            how = f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit code {code}"
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        mine = extra.get("metadist", {})
        return _Failed(rank, how, str(message.get("message", "")),
                       str(extra.get("py_callstack", "")), bool(mine.get("secondary", False)),
                       bool(mine.get("printed", False)), float(mine.get("time", failure.timestamp)),
                       tuple(int(r) for r in mine.get("stuck", ())))
    text = str(message)
    # torch elastic stops the other workers with SIGTERM once one has failed.
    stopped = code == -signal.SIGTERM
    if code >= 0 and "elastic/errors.html" in text:
        text = ("exited without a Python exception (sys.exit, os._exit, or a crash in native "
                "code: see its output)")
    elif stopped:
        text = "stopped by the launcher after another rank failed"
    elif code == -signal.SIGABRT:
        text = ABORTED
    elif code < 0:
        text = "no Python traceback: the process was killed (out of memory, or by a user?)"
    return _Failed(rank, how, text, "", stopped, False, float(failure.timestamp))


def summarize_run_failure(err: Any, script: str, killed: Collection[int] = ()) -> str:
    """One report for torch elastic's ``ChildFailedError``: the origin rank (its traceback was
    printed once above, or is shown here), then one line per other failed rank. For a
    collective timeout the origin is the rank(s) that did not arrive, named in the reporting
    rank's error file (``stuck``), and the reporter follows as "reported the timeout"."""
    rows = [_read(int(rank), failure, killed) for rank, failure in err.failures.items()]
    primary = [r for r in rows if not r.secondary] or rows
    origin = min(primary, key=lambda r: (not r.printed, r.when, r.rank))
    lines = [f"metadist run: {script} failed"]
    shown = {origin.rank}
    if origin.stuck:
        # A timeout: the rank that reported it only waited; the ranks it waited for are where
        # the job hung.
        by_rank = {r.rank: r for r in rows}
        for rank in origin.stuck:
            row = by_rank.get(rank)
            what = (f"{row.how}): {row.summary}" if row is not None
                    else "no report from it here: see its node's output)")
            lines.append(f"  origin rank: {rank} (hung: rank {origin.rank} waited for it; {what}")
            shown.add(rank)
        lines.append(f"  rank {origin.rank} reported the timeout ({origin.how}): {origin.summary}"
                     + (" (printed above)" if origin.printed else ""))
    else:
        lines.append(f"  origin rank: {origin.rank} ({origin.how}): {origin.summary}"
                     + (" (printed above)" if origin.printed else ""))
    if not origin.printed and origin.detail.strip():
        lines += ["    " + line for line in origin.detail.rstrip().splitlines()]
    for row in sorted(rows, key=lambda r: r.rank):
        if row.rank not in shown:
            kind = "stopped as a consequence" if row.secondary else "also failed"
            lines.append(f"  rank {row.rank} {kind} ({row.how}): {row.summary}")
    return "\n".join(lines)
