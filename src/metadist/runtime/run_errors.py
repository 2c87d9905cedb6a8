"""What ``metadist run`` says when the launch itself fails or is interrupted: one summary on
stderr, the full traceback in a log file it names.

The failures of the user's script are summarised from the workers' error files
(runtime/failures.py). The others come from torch's elastic launcher itself, as a traceback
of its own: the rendezvous port taken, Ctrl-C or SIGTERM, a rendezvous that does not
complete. Each gets one paragraph that says what happened and what to do.
"""

from __future__ import annotations

import os
import signal
import tempfile
import traceback
from pathlib import Path


def log_traceback(exc: BaseException) -> Path:
    """Write ``exc``'s traceback to a log file of its own; returns its path."""
    fd, name = tempfile.mkstemp(prefix="metadist-run-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(exc)))
    return Path(name)


def signal_number(exc: BaseException) -> int | None:
    """The signal that interrupted the launcher (Ctrl-C, SIGTERM), if that is what ``exc``
    is: torch elastic turns them into ``SignalException``; a plain Ctrl-C before its
    handlers are installed is a KeyboardInterrupt."""
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    sigval = getattr(exc, "sigval", None)
    return int(sigval) if sigval is not None else None


def explain(exc: BaseException, script: str, addr: str, port: int | None) -> tuple[str, int]:
    """(the summary for ``exc`` raised by the launcher, the exit status)."""
    log = log_traceback(exc)
    number = signal_number(exc)
    if number is not None:
        name = signal.Signals(number).name
        how = " (Ctrl-C)" if number == signal.SIGINT else ""
        return (f"metadist run: {script} was stopped by {name}{how}; every worker was sent "
                f"{name} and stopped (the launcher's traceback: {log})", 128 + number)
    text = str(exc)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        where = f"{addr}:{port}" if port else f"the rendezvous address {addr}"
        return (f"metadist run: cannot listen on {where}: the port is taken (EADDRINUSE), by "
                "another job or a run still shutting down. Choose another with --master-port "
                "(on one node, leave --master-addr and --master-port out: a free port is "
                f"found). (the launcher's traceback: {log})", 1)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return (f"metadist run: the launcher failed before or around {script}: "
            f"{type(exc).__name__}: {first} (the launcher's traceback: {log})", 1)
