"""Optimizer state by the layout descriptions (strategies/placement.py): a full state cut
into the tensors this rank steps, and this rank's state gathered into the full one. Loads,
consolidation and checkpoints of every sharded optimizer go through these two."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from metadist.comm import ops
from metadist.strategies.own_state import Own, own_states
from metadist.strategies.placement import (
    OptimizerPlacement,
    Part,
    Placement,
    Stepped,
    held,
    paste,
    per_element,
)


def cut_state(stepped: Sequence[Stepped], full: Mapping[int, Mapping[str, Any]]
              ) -> tuple[dict[torch.Tensor, dict[str, Any]], dict[torch.Tensor, Own]]:
    """This rank's state for the tensors it steps, cut from a full state by original index:
    per-element state pasted into a buffer laid out like the stepped tensor (zeros where a
    parameter has none, and in padding); per-parameter values those most of its parameters
    hold, and the others' own values (:func:`own_states`). A tensor that is one whole
    parameter takes its state as it is."""
    out: dict[torch.Tensor, dict[str, Any]] = {}
    owns: dict[torch.Tensor, Own] = {}
    for s in stepped:
        entries = [(p, full.get(int(p.name), {})) for p in s.params]
        if not any(e for _, e in entries):
            continue
        alone = (len(s.params) == 1 and s.params[0].whole() is not None
                 and s.layout == tuple(s.params[0].shape))  # not a flat's
        state: dict[str, Any] = {}
        if not alone:
            shared = sorted({k for p, e in entries for k, v in e.items()
                             if not per_element(k, v, p.shape)})
            state, owns[s.tensor] = own_states(
                [(p.name, {k: e[k] for k in shared if k in e} if e else None)
                 for p, e in entries], shared)
        for name in sorted({k for _, e in entries for k in e}):
            holders = [(p, e[name]) for p, e in entries if name in e]
            if alone:
                state[name] = holders[0][1]
                continue
            if not all(per_element(name, v, p.shape) for p, v in holders):
                continue
            buf = torch.zeros(math.prod(s.layout), dtype=holders[0][1].dtype,
                              device=s.tensor.device)
            for p, v in holders:
                flat = v.detach().reshape(-1)
                for part in p.parts:
                    paste(part.on(buf), flat[part.start:part.stop])
            state[name] = buf.view(s.layout)
        out[s.tensor] = state
    return out, owns


def _writes(placement: Placement, rank: int) -> bool:
    return placement.writer == "holder" or (placement.writer in ("spread", "rank0")
                                            and rank == 0)


def gather_state(where: OptimizerPlacement, optimizer: Optimizer, to: int | None
                 ) -> dict[int, dict[str, Any]] | None:
    """Collective: the full state by original index, assembled from what each rank writes
    (copies on the CPU, never aliases of the live state), on every rank (``to=None``) or
    only on global rank ``to`` (``None`` elsewhere)."""
    rank = ops.group_info(None)[2]
    # (index, state name, global shape or None for a per-parameter value, pieces or value)
    mine: list[tuple[int, str, tuple[int, ...] | None, Any]] = []
    for s in where.stepped:
        state = optimizer.state.get(s.tensor)
        if not state:
            continue
        for p in s.params:
            held_state = s.state_for(p, state)
            for name, value in (held_state or {}).items():
                if per_element(name, value, s.layout):
                    placed = p.on(value)
                    if placed.parts and _writes(placed, rank):
                        mine.append((int(p.name), name, p.shape, [
                            (q.start, q.stop, held(q).to("cpu", copy=True))
                            for q in placed.parts]))
                elif s.lead:
                    mine.append((int(p.name), name, None, value.detach().to("cpu", copy=True)
                                 if isinstance(value, torch.Tensor) else value))
    per_rank = ops.all_gather_object(mine) if to is None else ops.gather_object(mine, to)
    if per_rank is None:
        return None
    out: dict[int, dict[str, Any]] = {}
    for i, name, shape, got in (item for items in per_rank for item in items):
        entry = out.setdefault(i, {})
        if shape is None:
            entry[name] = got
            continue
        if len(got) == 1 and got[0][:2] == (0, math.prod(shape)):  # one rank holds it whole
            entry[name] = got[0][2].view(shape)
            continue
        if name not in entry:
            entry[name] = torch.zeros(shape, dtype=got[0][2].dtype)
        for start, stop, data in got:
            paste(Part(start, stop, entry[name], start), data)
    return out
