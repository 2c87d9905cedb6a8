"""Checkpoints: save and load a training state under any strategy, restore it under any other.

``strategy.save(path, state, format=...)`` / ``strategy.load(path, state)`` (collective),
where ``state`` is a dict such as ``{"model": model, "optimizer": optimizer, "scheduler":
scheduler, "scaler": strategy.scaler, "loader": loader, "step": 12}`` (see
:mod:`metadist.checkpoint.entries` for what each kind of value becomes).

Formats:

* ``"sharded"`` (default): a directory; every rank writes only what it holds (zero3/hsdp
  shard slices, zero1/zero2 owned optimizer state, replicated tensors once, spread over the
  ranks) as raw bytes, with a JSON index (:mod:`~metadist.checkpoint.index`).
* ``"full"``: one file written by rank 0, a plain ``torch.load`` gives your state's names
  with the model's state dict under its name (:mod:`~metadist.checkpoint.full`).
  ``metadist consolidate DIR FILE`` turns a sharded checkpoint into this format.

Either loads into any strategy at any world size: each rank reads just the element ranges
it will hold (:mod:`~metadist.checkpoint.restore`). Every rank's RNG state is restored
(:mod:`~metadist.checkpoint.rng`). Saves are atomic (a marker written last, by a rename);
loads never unpickle arbitrary objects (raw bytes, JSON, ``torch.load(weights_only=True)``),
check every byte they trust against a checksum before using it (SHA-256 digests of whole
files, CRC-32s of pieces: :mod:`~metadist.checkpoint.digest`), and change nothing in memory
unless every rank succeeded.

torch's distributed checkpoint (DCP) reads and writes the same state through
:mod:`~metadist.checkpoint.dcp` (torch's state-dict format, each rank's element ranges as
DCP boxes). The formats here stay the default: DCP's metadata file is a pickle (loading it
can run arbitrary code) and it offers no atomic commit, so an interrupted save could
destroy the previous checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metadist.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

if TYPE_CHECKING:
    from metadist.strategies.base import Strategy

# The implementation imports the strategies, which import this package (activation
# checkpointing): import it on first use so either side can be imported first.


def save(strategy: Strategy, path: str | os.PathLike[str], state: dict[str, Any], *,
         format: str = "sharded") -> None:
    """Collective, atomic: save ``state`` to ``path`` ("sharded" directory or "full" file)."""
    from metadist.checkpoint import api

    api.save(strategy, path, state, format=format)


def load(strategy: Strategy, path: str | os.PathLike[str], state: dict[str, Any]
         ) -> dict[str, Any]:
    """Collective: restore ``state`` in place from ``path``; returns the plain values saved."""
    from metadist.checkpoint import api

    return api.load(strategy, path, state)


def consolidate(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """One process: write a sharded checkpoint as one full-format file; returns ``out``."""
    from metadist.checkpoint.consolidation import consolidate as run

    return run(checkpoint, out)


__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "consolidate",
    "load",
    "save",
]
