"""Agreement across ranks: an error on any rank fails every rank with the same error.

Saving and loading run collectives; a rank that raised on its own would leave the others
waiting in the next one. Instead each rank catches its error, every rank learns every
rank's outcome in one collective, and all raise the same exception, naming the origin rank.
"""

from __future__ import annotations

import errno
from typing import Any

from metadist.checkpoint.errors import ERRORS, CheckpointError
from metadist.comm import ops

#: an error as it travels between ranks: (class name, message)
Failure = tuple[str, str]


def failure(exc: BaseException) -> Failure:
    """``exc`` in a picklable form; errors other than checkpoint errors keep their type name."""
    if isinstance(exc, CheckpointError):
        return type(exc).__name__, str(exc)
    hint = ""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = (": the file system is full (or the quota used up); free space there or save "
                "to another directory")
    return CheckpointError.__name__, f"{type(exc).__name__}: {exc}{hint}"


def to_exception(fail: Failure, rank: int, world_size: int, action: str) -> CheckpointError:
    """The error every rank raises for rank ``rank``'s failure: on the other ranks it is a
    consequence (secondary), so launchers name ``rank`` as the origin."""
    cls = ERRORS.get(fail[0], CheckpointError)
    where = f" on rank {rank}" if world_size > 1 else ""
    err = cls(f"{action} failed{where}: {fail[1]}")
    err.secondary = world_size > 1 and ops.group_info(None)[2] != rank
    return err


def agree(mine: Failure | None, action: str, payload: Any = None) -> list[Any]:
    """Collective: every rank's ``payload`` in rank order, or the first failure raised on
    every rank (the origin rank named). ``action`` says what failed ("saving /ckpt")."""
    rows = ops.all_gather_object((mine, payload))
    for rank, (fail, _) in enumerate(rows):
        if fail is not None:
            raise to_exception(fail, rank, len(rows), action)
    return [p for _, p in rows]


def announce(found: tuple[int, Failure] | None, action: str, world_size: int) -> None:
    """Collective: rank 0 tells every rank whether (and on which rank) the operation failed."""
    outcome = ops.broadcast_object(found, 0)
    if outcome is not None:
        raise to_exception(outcome[1], outcome[0], world_size, action)
