"""Exceptions a user can meet, each saying what went wrong and what to do."""

from __future__ import annotations


class MetadistError(RuntimeError):
    """Base class for errors raised by metadist."""


class NotInitializedError(MetadistError):
    """A distributed call was made before :func:`metadist.init`."""


class RankFailedError(MetadistError):
    """A rank of a job started by :func:`metadist.launch` raised; carries its traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = traceback
        super().__init__(
            f"rank {rank} failed with {exc_type}: {message}\n"
            f"--- traceback of rank {rank} ---\n{traceback.rstrip()}"
        )


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
    """Ranks entered different collectives at the same point of the program."""
