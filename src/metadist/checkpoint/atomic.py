"""Crash-safe file system steps: write to a temporary name next to the target, fsync, rename.

A rename within one directory is atomic on POSIX file systems, so a reader sees either the
old file or the new one, never a mix; fsyncing the file before the rename and the directory
after it makes the result survive a power loss too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


def token() -> str:
    """A fresh random suffix for temporary names (distinct across concurrent saves)."""
    return secrets.token_hex(6)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in directory ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories: nothing more to do
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def durable_file(path: Path) -> Iterator[IO[bytes]]:
    """Open ``path`` for writing; flushed and fsynced when the block ends."""
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through ``write(file)`` so it appears complete or not at all."""
    tmp = path.with_name(f".{path.name}.tmp-{token()}")
    try:
        with durable_file(tmp) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Remove a file or directory, ignoring what is already gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()
