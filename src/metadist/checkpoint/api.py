"""``save`` and ``load``: format choice, agreement across ranks, then the format's own steps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from metadist.checkpoint import full, restore, sharded
from metadist.checkpoint.agree import Failure, agree, failure
from metadist.checkpoint.atomic import remove_tree, token
from metadist.checkpoint.entries import Entry, entries_of
from metadist.checkpoint.errors import CheckpointError
from metadist.checkpoint.index import DATA_PREFIX
from metadist.checkpoint.source import open_source
from metadist.strategies.base import Strategy

FORMATS = ("sharded", "full")


def save(strategy: Strategy, path: str | os.PathLike[str], state: dict[str, Any], *,
         format: str = "sharded") -> None:
    """Collective: save ``state`` to ``path`` in ``format`` ("sharded": a directory every rank
    writes its part into; "full": one file from rank 0). Atomic: until it returns, the
    previous checkpoint at ``path`` (if any) stays intact and loadable."""
    match format:
        case "sharded" | "full":
            pass
        case _:
            raise ValueError(f"checkpoint format {format!r} is not known; choose one of: "
                             f"{', '.join(FORMATS)}")
    target = Path(path)
    w = strategy.world
    action = f"saving checkpoint {target}"
    mine: Failure | None = None
    entries: list[Entry] = []
    version = ""
    try:
        entries = entries_of(state)
        if w.rank == 0 and format == "sharded":
            version = DATA_PREFIX + token()
            sharded.prepare(target, version)
        elif w.rank == 0:
            full.prepare(target)
    except Exception as exc:
        mine = failure(exc)
    signature = [(e.name, e.kind) for e in entries]
    try:
        rows = agree(mine, action, (signature, version))
        differing = [r for r, (sig, _) in enumerate(rows) if sig != rows[0][0]]
        if differing:
            raise CheckpointError(
                f"{action} failed: ranks passed different state: rank 0 has {rows[0][0]}, "
                f"rank {differing[0]} has {rows[differing[0]][0]}; pass the same names (and "
                "kinds of objects) on every rank")
    except CheckpointError:
        if version:
            remove_tree(target / version)
        raise
    if format == "sharded":
        sharded.save_sharded(target, entries, rows[0][1], rank=w.rank, world_size=w.world_size,
                             strategy=strategy.name)
    else:
        full.save_full(strategy, target, entries, rank=w.rank, world_size=w.world_size)


def load(strategy: Strategy, path: str | os.PathLike[str], state: dict[str, Any]
         ) -> dict[str, Any]:
    """Collective: restore ``state`` in place from the checkpoint at ``path`` (either format,
    any strategy, any world size); returns every plain value the checkpoint holds. On any
    error every rank raises and nothing in memory has changed."""
    target = Path(path)
    w = strategy.world
    mine: Failure | None = None
    plan: restore.Plan | None = None
    try:
        entries = entries_of(state)
        source = open_source(target)
        try:
            plan = restore.plan(source, entries, state, w.rank)
        finally:
            source.close()
    except Exception as exc:
        mine = failure(exc)
    agree(mine, f"loading checkpoint {target}")  # every rank is ready: only now copy in
    assert plan is not None
    plan.apply()
    return dict(plan.plain)
