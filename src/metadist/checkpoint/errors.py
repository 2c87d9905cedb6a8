"""Errors of saving and loading checkpoints. A failed load has changed nothing in memory."""

from __future__ import annotations

from metadist.errors import MetadistError


class CheckpointError(MetadistError):
    """A checkpoint could not be saved or loaded; the message names the file and the key."""


class IncompleteCheckpointError(CheckpointError):
    """The path holds no completed checkpoint (its marker is missing: an interrupted save)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is unreadable, truncated, fails its checksum or is not metadist's."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit what it is loaded into (keys, shapes, parameter counts)."""


#: by name, so an error raised on one rank is re-raised with its class on every rank
ERRORS: dict[str, type[CheckpointError]] = {
    cls.__name__: cls for cls in (CheckpointError, IncompleteCheckpointError,
                                  CorruptCheckpointError, CheckpointMismatchError)}
