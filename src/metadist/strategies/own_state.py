"""The optimizer state one process holds for each parameter, where a stepped tensor holds
several parameters (zero3's flat shards) whose per-parameter values differ: Adam's step
count of a parameter the steps skipped (strategies/zero3/unreached.py) stays where one process
left it while its shard's moves on. Descriptions (:attr:`~metadist.strategies.placement.
Stepped.own`), consolidation, checkpoints and loads speak of it in these terms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

Own = dict[str, dict[str, Any] | None]
#: a local optimizer state dict's record of the parameters whose state differs from their
#: stepped tensor's (``Stepped.own``), by the stepped tensor's position
OWN = "metadist_own"


def own_states(entries: Sequence[tuple[str, Mapping[str, Any] | None]], shared: Sequence[str]
               ) -> tuple[dict[str, Any], Own]:
    """Per-parameter values of the parameters that one tensor steps, given as (name, its
    per-parameter values, or None if it has no state): the values most of them hold become
    the tensor's; a parameter holding others, or no state while others do, keeps its own
    (``Stepped.own``). ``shared``: the per-parameter state names."""
    def values(e: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(e.get(k) for k in shared)

    kinds: list[tuple[tuple[Any, ...], int]] = []  # (values, how many hold them)
    for _, e in entries:
        if e is not None:
            for j, (v, n) in enumerate(kinds):
                if _same(v, values(e)):
                    kinds[j] = (v, n + 1)
                    break
            else:
                kinds.append((values(e), 1))
    if not kinds:
        return {}, {}
    common = max(kinds, key=lambda kind: kind[1])[0]  # the first of the most held
    own: Own = {}
    for name, e in entries:
        if e is None:
            own[name] = None
        elif not _same(values(e), common):
            own[name] = {k: e[k] for k in shared if k in e}
    return {k: v for k, v in zip(shared, common, strict=True) if v is not None}, own


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
               else x == y for x, y in zip(a, b, strict=True))
