"""The full format: one file, written by rank 0, readable by a plain ``torch.load``.

``torch.load(path, weights_only=True)`` gives a dict with your state's names at the top
level: a module's state dict (your module's keys; zero3 gathers it) under its name, e.g.
``["model"]``; an optimizer's state in the plain single-process format; a scheduler's,
scaler's or loader's ``state_dict()``; plain values as they were. metadist's header is under
``["metadist"]``: format and version, the writing strategy and world size, each entry's kind,
optimizer parameter shapes, every rank's RNG state, and a CRC-32 per tensor. The archive's
comment is the SHA-256 of all its other bytes (:mod:`~metadist.checkpoint.digest`), checked
before the file is parsed.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.checkpoint import rng
from metadist.checkpoint.agree import Failure, announce, failure
from metadist.checkpoint.atomic import write_atomic
from metadist.checkpoint.digest import write_sealed_zip
from metadist.checkpoint.entries import (
    HEADER,
    Entry,
    Key,
    check_plain,
    describe,
    is_piece_tensor,
    plain_copy,
)
from metadist.checkpoint.errors import CheckpointError
from metadist.checkpoint.index import FULL, VERSION, EntryMeta
from metadist.checkpoint.pieces import checksum
from metadist.comm import ops
from metadist.strategies.base import Strategy
from metadist.strategies.placement import optimizer_placement


def prepare(path: Path) -> None:
    """Rank 0, before anything is written."""
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory (a sharded checkpoint?) but the full format is one file; "
            "save to another path, remove the directory, or pass format='sharded'")
    path.parent.mkdir(parents=True, exist_ok=True)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes (a view would make torch.save write the whole
    buffer behind it, e.g. zero1's flat parameter regions)."""
    t = t.detach().cpu()
    if (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def document(entries: dict[str, EntryMeta], contents: dict[str, Any], *, world_size: int,
             strategy: str, rngs: list[dict[str, Any]]) -> dict[str, Any]:
    """The full-format dict: ``contents`` (name -> module state dict, plain optimizer state,
    stateful state or value) checked, moved to the CPU and checksummed, plus the header."""
    doc: dict[str, Any] = {}
    crc: dict[Key, int] = {}
    compacted: dict[int, torch.Tensor] = {}  # tied weights stay one tensor

    def piece(key: Key, t: torch.Tensor) -> torch.Tensor:
        out = compacted.get(id(t))
        if out is None:
            out = compacted[id(t)] = _compact(t)
        crc[key] = checksum(out)
        return out

    for name, meta in entries.items():
        value = contents[name]
        match meta.kind:
            case "module":
                sd: OrderedDict[str, Any] = OrderedDict()
                for key, v in value.items():
                    check_plain(v, describe((name, key)))
                    sd[key] = piece((name, key), v) if is_piece_tensor(v) else plain_copy(v)
                doc[name] = sd
            case "optimizer":
                groups = value["param_groups"]
                check_plain(groups, f"{describe((name,))} param_groups")
                position = {pid: i for i, pid in enumerate(p for g in groups for p in g["params"])}
                state: dict[Any, dict[str, Any]] = {}
                for pid, entry in value["state"].items():
                    state[pid] = {}
                    for state_name, v in entry.items():
                        key = (name, str(position[pid]), state_name)
                        check_plain(v, describe(key))
                        state[pid][state_name] = piece(key, v) if is_piece_tensor(v) else (
                            plain_copy(v))
                doc[name] = {"state": state, "param_groups": plain_copy(groups)}
            case "stateful":
                check_plain(value, f"{describe((name,))}.state_dict()")
                doc[name] = plain_copy(value)
            case _:
                doc[name] = plain_copy(value)
    doc[HEADER] = {
        "format": FULL, "version": VERSION, "world_size": world_size, "strategy": strategy,
        # str(): torch's TorchVersion is not among the types a weights_only load accepts
        "torch": str(torch.__version__), "rng": rngs, "crc32": crc,
        "entries": {name: {"kind": m.kind, "shapes": [list(s) for s in m.shapes]}
                    for name, m in entries.items()}}
    return doc


def _optimizer_state(strategy: Strategy, optimizer: Optimizer, rank: int) -> Any:
    """Plain-format state on rank 0 (collective for sharded optimizers)."""
    if hasattr(optimizer, "metadist_sharding") or any(
            s.state_shape is not None for s in optimizer_placement(optimizer).stepped):
        return strategy.optimizer_state_dict(optimizer, to=0)
    return optimizer.state_dict() if rank == 0 else None  # replicated: rank 0 has it all


def save_full(strategy: Strategy, path: Path, entries: list[Entry], *, rank: int,
              world_size: int) -> None:
    """Collective: gather everything to rank 0, which writes ``path`` atomically."""
    contents: dict[str, Any] = {}
    metas: dict[str, EntryMeta] = {}
    # Collectives first, in the same order on every rank (zero3 state dicts gather).
    for e in entries:
        metas[e.name] = EntryMeta(e.kind)
        match e.kind:
            case "module":
                module: nn.Module = e.value
                # Every rank: a collective under zero3/hsdp (also through a wrapper such as
                # torch.compile(model)); elsewhere references to the tensors, at no cost.
                state = module.state_dict()
                contents[e.name] = state if rank == 0 else None
            case "optimizer":
                contents[e.name] = _optimizer_state(strategy, e.value, rank)
                metas[e.name].shapes = list(optimizer_placement(e.value).shapes)
    rngs = ops.gather_object(rng.capture(), 0)
    found: tuple[int, Failure] | None = None
    if rank == 0:
        try:
            for e in entries:
                if e.kind == "stateful":
                    contents[e.name] = e.value.state_dict()
                elif e.kind == "value":
                    contents[e.name] = e.value
            assert rngs is not None
            doc = document(metas, contents, world_size=world_size, strategy=strategy.name,
                           rngs=rngs)
            write_atomic(path, lambda f: write_sealed_zip(f, lambda s: torch.save(doc, s)))
        except Exception as exc:
            found = (0, failure(exc))
    announce(found, f"saving checkpoint {path}", world_size)
