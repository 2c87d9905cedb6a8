"""Each line a rank prints reaches the terminal, pipe or log file whole.

Several ranks write to one inherited terminal or pipe. With unbuffered output (``python -u``,
what launchers use) a ``print`` is two writes, its text and its newline, and another rank's
write can fall between them: lines arrive joined or split. Here a rank's ``sys.stdout`` and
``sys.stderr`` collect text until a line is complete and write each line with one
``write(2)``, which a pipe delivers whole up to ``PIPE_BUF`` (4 KiB) and a terminal or a file
in one piece. Optionally each line starts with the rank (``METADIST_RANK_PREFIX=1``, which
``metadist run --rank-prefix`` sets), as torchrun's log prefix does.

A partial line is written when the program flushes (a progress bar's ``\\r``, ``print(...,
end="", flush=True)``): only then can another rank's line fall inside it.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from typing import Any, TextIO

PREFIX_VAR = "METADIST_RANK_PREFIX"


class LineWriter(io.TextIOBase):
    """A text stream over ``stream``'s file descriptor that writes whole lines at once."""

    def __init__(self, stream: TextIO, prefix: str = "") -> None:
        super().__init__()
        self._stream = stream
        self._fd = stream.fileno()
        self._prefix = prefix
        self._pending = ""
        self._at_line_start = True
        self._lock = threading.Lock()

    # ----- what a text stream is asked about: the original's answers ----------------------
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self._stream.errors

    @property
    def buffer(self) -> Any:
        return self._stream.buffer

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return self._stream.isatty()

    def writable(self) -> bool:
        return True

    # ----- writing ---------------------------------------------------------------------------
    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._pending = (self._pending + text).split("\n")
            for line in lines:
                self._emit(line + "\n")
                self._at_line_start = True
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._pending)
                self._pending, self._at_line_start = "", False

    def _emit(self, text: str) -> None:
        head = self._prefix if self._at_line_start else ""
        data = (head + text).encode(self.encoding, errors="replace")
        while data:  # one write for a line up to PIPE_BUF; a longer one may take several
            written = os.write(self._fd, data)
            data = data[written:]


def install(rank: int | str) -> None:
    """Make this process's ``sys.stdout`` and ``sys.stderr`` line-atomic (prefixed with the
    rank when ``METADIST_RANK_PREFIX`` is set); a stream without a file descriptor (a test
    capturing output) is left as it is."""
    prefix = f"[rank {rank}] " if os.environ.get(PREFIX_VAR, "") not in ("", "0") else ""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, LineWriter) or stream is None:
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        stream.flush()
        setattr(sys, name, LineWriter(stream, prefix))
