"""Turn a sharded checkpoint into one full-format file, in one process (no process group).

The result loads with ``strategy.load`` under any strategy and world size, and with a plain
``torch.load(out, weights_only=True)``: the model's state dict is under the name it was saved
with (e.g. ``["model"]``), see :mod:`metadist.checkpoint.full`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from metadist.checkpoint.atomic import write_atomic
from metadist.checkpoint.digest import write_sealed_zip
from metadist.checkpoint.entries import Key
from metadist.checkpoint.full import document
from metadist.checkpoint.source import Source, open_source


def _contents(source: Source) -> dict[str, Any]:
    contents: dict[str, Any] = {}
    for name, meta in source.entries.items():
        match meta.kind:
            case "module":
                tensors: dict[Key, torch.Tensor] = {}  # tied names share one tensor
                sd: OrderedDict[str, Any] = OrderedDict()
                for key in meta.keys:
                    stored = source.module_key(name, key)
                    if stored in source.tensors:
                        if stored not in tensors:
                            tensors[stored] = source.full(stored)
                        sd[key] = tensors[stored]
                    else:
                        sd[key] = source.value(stored)
                contents[name] = sd
            case "optimizer":
                state: dict[int, dict[str, Any]] = {}
                for i, names in source.optimizer_state(name).items():
                    state[i] = {}
                    for state_name in names:
                        where = (name, str(i), state_name)
                        state[i][state_name] = (source.full(where) if where in source.tensors
                                                else source.value(where))
                contents[name] = {"state": state, "param_groups": source.param_groups[name]}
            case "stateful":
                contents[name] = source.stateful[name]
            case _:
                contents[name] = source.plain[name]
    return contents


def consolidate(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the checkpoint at ``checkpoint`` (sharded, or full) as one full-format file
    ``out``, atomically; returns ``out``. Needs memory for the whole model and optimizer."""
    target = Path(out)
    source = open_source(Path(checkpoint))
    try:
        doc = document(source.entries, _contents(source), world_size=source.world_size,
                       strategy=source.strategy, rngs=source.rng)
    finally:
        source.close()
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, lambda f: write_sealed_zip(f, lambda s: torch.save(doc, s)))
    return target
