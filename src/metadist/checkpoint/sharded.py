"""Saving the sharded format: every rank writes what it holds, rank 0 commits.

On disk, ``path/`` holds ``metadata.json`` (index and completion marker) and version
directories ``v-<token>/`` with ``rank-NNNNN.bin`` (raw piece bytes) and ``objects.pt``.

Commit protocol, crash-safe at every step:

1. rank 0 creates a fresh ``v-<token>/`` (agreed by every rank before anything is written);
2. every rank writes and fsyncs its data file there, then reports its pieces to rank 0
   (the gather doubles as the barrier: rank 0 continues only when all files are durable);
3. rank 0 writes ``objects.pt`` and then ``metadata.json`` through a temporary file and an
   atomic rename: from that instant the new checkpoint is the one at ``path``;
4. rank 0 removes older version directories and leftovers of interrupted saves.

A crash before step 3 leaves the previous ``metadata.json``, which still names the previous
version directory, untouched: the previous checkpoint stays loadable.
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import Any

import torch

from metadist.checkpoint import rng
from metadist.checkpoint.agree import Failure, announce, failure
from metadist.checkpoint.atomic import durable_file, fsync_dir, remove_tree, write_atomic
from metadist.checkpoint.capture import Capture, capture
from metadist.checkpoint.digest import seal_json
from metadist.checkpoint.entries import Entry, describe
from metadist.checkpoint.errors import CheckpointError
from metadist.checkpoint.index import DATA_PREFIX, MARKER, OBJECTS, encode, rank_file
from metadist.checkpoint.pieces import PieceRecord, Slice, write_slices
from metadist.comm import ops


def write_rank_file(path: Path, slices: list[Slice]) -> list[PieceRecord]:
    """Write this rank's data file (a seam for tests that simulate a crash mid-save)."""
    return write_slices(path, slices)


def prepare(path: Path, version: str) -> None:
    """Rank 0, before anything is written: the directory and a fresh version directory."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"{path} is a file (a full checkpoint?) but sharded checkpoints are directories; "
            "save to another path, remove the file, or pass format='full'")
    path.mkdir(parents=True, exist_ok=True)
    (path / version).mkdir()


def save_sharded(path: Path, entries: list[Entry], version: str, *, rank: int, world_size: int,
                 strategy: str) -> None:
    """Collective: write ``entries`` into ``path / version`` and commit (module docstring)."""
    data = path / version
    mine: Failure | None = None
    report: tuple[list[PieceRecord], dict[Any, Any], dict[str, Any], int,
                  dict[Any, int]] | None = None
    ours: Capture | None = None
    try:
        if not data.is_dir():
            raise CheckpointError(
                f"{data} (created by rank 0) is not visible here: a sharded checkpoint needs a "
                "directory every rank shares; use a shared file system or format='full'")
        ours = capture(entries, rank, world_size)
        target = data / rank_file(rank)
        records = write_rank_file(target, ours.slices)
        report = (records, ours.values, rng.capture(), target.stat().st_size, ours.replicas)
    except Exception as exc:
        mine = failure(exc)
    reports = ops.gather_object((mine, report), 0)
    found: tuple[int, Failure] | None = None
    if reports is not None:  # rank 0
        failed = [(r, f) for r, (f, _) in enumerate(reports) if f is not None]
        if failed:
            found = failed[0]
        elif (differ := _differing_replicas([r for _, r in reports], strategy)) is not None:
            found = differ
        else:
            try:
                assert ours is not None
                _commit(path, version, ours, [r for _, r in reports], world_size, strategy)
            except Exception as exc:
                found = (0, failure(exc))
        if found is not None:
            remove_tree(data)
    announce(found, f"saving checkpoint {path}", world_size)


def _differing_replicas(reports: list[Any], strategy: str) -> tuple[int, Failure] | None:
    """The first rank whose replica of a replicated tensor differs from rank 0's, as a
    failure of that rank (None: every replica is equal)."""
    first = reports[0][4]
    for rank, report in enumerate(reports[1:], 1):
        for key, crc in report[4].items():
            if first.get(key) != crc:
                return rank, (CheckpointError.__name__, (
                    f"{describe(key)} must be equal on every rank under '{strategy}' (each "
                    f"holds a replica), but rank {rank}'s differs from rank 0's: the ranks' "
                    "training diverged (a rank that changed parameters or optimizer state by "
                    "itself, outside the optimizer's step, or stepped with other gradients). "
                    "Nothing was saved, so a checkpoint never mixes pieces of different "
                    "replicas; make every rank apply the same updates"))
    return None


def _commit(path: Path, version: str, ours: Capture, reports: list[Any], world_size: int,
            strategy: str) -> None:
    """Rank 0: objects, then the marker (the commit), then clean up older versions."""
    data = path / version
    records: list[PieceRecord] = []
    values: dict[Any, Any] = {}
    rngs, files = [], {}
    for rank, (rank_records, rank_values, rank_rng, size, _) in enumerate(reports):
        records += rank_records
        values.update(rank_values)
        rngs.append(rank_rng)
        files[rank_file(rank)] = size
    objects = {"rng": rngs, "values": values, "param_groups": ours.param_groups,
               "stateful": ours.stateful, "plain": ours.plain}
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    blob = buffer.getvalue()
    with durable_file(data / OBJECTS) as f:
        f.write(blob)
    fsync_dir(data)
    doc = encode(data=version, world_size=world_size, strategy=strategy, entries=ours.entries,
                 records=records, files=files, objects=(len(blob), zlib.crc32(blob)))
    write_atomic(path / MARKER, lambda f: f.write(seal_json(doc)))
    # Committed. Earlier versions and leftovers of interrupted saves are garbage now.
    for child in path.iterdir():
        stale_version = child.name.startswith(DATA_PREFIX) and child.name != version
        if stale_version or child.name.startswith(f".{MARKER}.tmp-"):
            remove_tree(child)
