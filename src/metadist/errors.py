"""Exceptions a user can meet, each saying what went wrong and what to do.

Errors that one rank raises only *because another rank failed first* (its peer vanished, the
watchdog stopped it after another rank's report, a mismatch found on every rank) carry
``secondary = True``: launchers show the origin rank's traceback once and these as one line.
"""

from __future__ import annotations


class MetadistError(RuntimeError):
    """Base class for errors raised by metadist."""

    secondary: bool = False


class NotInitializedError(MetadistError):
    """A distributed call was made before :func:`metadist.init`."""


class RendezvousError(MetadistError):
    """:func:`metadist.init` could not form the process group (in time, or at all)."""


class WorldMismatchError(RendezvousError):
    """The processes of a job disagree about it (world size, backend, who holds which rank)."""


class RankFailedError(MetadistError):
    """A rank of a job started by :func:`metadist.launch` raised; carries its traceback.

    ``rank`` is the origin: the rank that raised, or, for a collective timeout, the first
    rank that did not arrive (``hung`` lists them all; ``reported_by`` is the rank that waited
    and raised, and ``remote_traceback`` shows where it waited). ``others`` maps the ranks
    that failed afterwards, as a consequence, to a one-line summary.
    """

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str,
                 others: dict[int, str] | None = None, hung: tuple[int, ...] = ()) -> None:
        self.reported_by = rank
        self.hung = tuple(hung)
        self.rank = self.hung[0] if self.hung else rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = traceback
        self.others = dict(others or {})
        if self.hung:
            text = "".join(f"rank {r} did not arrive (rank {rank} waited for it): "
                           f"{self.others.pop(r, 'no report from it')}\n" for r in self.hung)
            text += f"rank {rank} reported the timeout with {exc_type}: {message}"
        else:
            text = f"rank {rank} failed with {exc_type}: {message}"
        if traceback.strip():
            text += f"\n--- traceback of rank {rank} ---\n{traceback.rstrip()}"
        if self.others:
            text += "\n--- other ranks, stopped as a consequence ---\n" + "\n".join(
                f"rank {r}: {line}" for r, line in sorted(self.others.items()))
        super().__init__(text)


class LaunchTimeoutError(MetadistError):
    """Ranks did not finish in time; the message names them and shows where they were."""

    def __init__(self, ranks: list[int], timeout: float, stacks: dict[int, str]) -> None:
        self.ranks = ranks
        self.timeout = timeout
        self.stacks = stacks
        shown = "\n".join(
            f"--- stack of rank {r} ---\n{stacks[r].rstrip()}" for r in ranks if stacks.get(r)
        )
        super().__init__(
            f"rank(s) {', '.join(map(str, ranks))} did not finish within {timeout:.0f}s "
            "(a hang, often a collective that another rank never entered); they were killed."
            + (f"\n{shown}" if shown else "")
        )


class CollectiveMismatchError(MetadistError):
    """Ranks entered different collectives (op, order, shape or dtype) at the same point.

    Raised on every rank of the group by debug mode; only the first rank that differs from
    the others is the origin, the copies on the other ranks are secondary.
    """

    def __init__(self, message: str, *, secondary: bool = False) -> None:
        super().__init__(message)
        self.secondary = secondary


class CollectiveTimeoutError(MetadistError):
    """A collective did not complete within the timeout: names the op, its sequence number on
    its group and the ranks that did not arrive."""

    def __init__(self, message: str, *, op: str = "", seq: int = 0,
                 missing: tuple[int, ...] = (), secondary: bool = False) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.missing = missing
        self.secondary = secondary


class CollectiveFailedError(MetadistError):
    """A collective broke because a peer went away: a consequence of that rank's failure
    (it crashed, was killed, or raised and exited), whose own error is the one to read; or,
    when the peer left cleanly, of programs that diverged, and then this error is the origin."""

    secondary = True

    def __init__(self, message: str, *, op: str = "", seq: int = 0,
                 missing: tuple[int, ...] = (), secondary: bool = True) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.missing = missing
        self.secondary = secondary  # False when the lost peer left cleanly: this is the origin


class CollectiveAloneError(MetadistError):
    """A collective was called from code that one rank runs by itself (rank 0's validation):
    the other ranks are not there to join it, so it would wait out the collective timeout.
    Raised at once, naming the region and what to do instead."""

    def __init__(self, message: str, *, op: str = "", region: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.region = region
