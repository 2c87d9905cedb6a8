"""The sharded format's index, ``metadata.json``: written last, it is the completion marker.

::

    {"format": "metadist.sharded", "version": 1, "byteorder": "little", "data": "v-<token>",
     "world_size": 2, "strategy": "zero3", "torch": "2.13.0",
     "entries": [{"name": "model", "kind": "module", "keys": [...], "aliases": {...}},
                 {"name": "optimizer", "kind": "optimizer", "shapes": [[16, 10], ...]}, ...],
     "tensors": [{"key": ["model", "inp.weight"], "shape": [16, 10], "dtype": "float32",
                  "pieces": [{"file": "rank-00001.bin", "offset": 0, "start": 80,
                              "stop": 160, "crc32": 1234}, ...]}, ...],
     "files": {"rank-00000.bin": {"bytes": 4096}, "objects.pt": {"bytes": 900, "crc32": 5}}}

Everything else (optimizer hyperparameters, scalar state, scheduler/scaler/loader state, plain
values, every rank's RNG state) is in ``objects.pt``, read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from metadist.checkpoint.entries import KINDS, Key, Kind, describe
from metadist.checkpoint.errors import CorruptCheckpointError
from metadist.checkpoint.pieces import Piece, PieceRecord, TensorInfo, parse_dtype

SHARDED = "metadist.sharded"
FULL = "metadist.full"
VERSION = 1
MARKER = "metadata.json"
OBJECTS = "objects.pt"
DATA_PREFIX = "v-"  # version directories; the marker names the current one


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


@dataclass
class EntryMeta:
    """What a checkpoint records about one entry beyond its tensors."""

    kind: Kind
    keys: list[str] = field(default_factory=list)  # module: state-dict keys, aliases included
    aliases: dict[str, str] = field(default_factory=dict)  # module: tied name -> stored name
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # optimizer: parameter shapes

    def to_json(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "kind": self.kind}
        if self.kind == "module":
            out.update(keys=self.keys, aliases=self.aliases)
        if self.kind == "optimizer":
            out["shapes"] = [list(s) for s in self.shapes]
        return out


@dataclass(frozen=True)
class Index:
    data: str
    world_size: int
    strategy: str
    entries: dict[str, EntryMeta]
    tensors: dict[Key, tuple[TensorInfo, list[Piece]]]
    files: dict[str, int]
    objects_bytes: int
    objects_crc32: int


def encode(*, data: str, world_size: int, strategy: str, entries: dict[str, EntryMeta],
           records: list[PieceRecord], files: dict[str, int], objects: tuple[int, int]
           ) -> dict[str, Any]:
    """The index of a checkpoint from every rank's piece records (coverage is checked)."""
    by_key: dict[Key, tuple[tuple[int, ...], str, list[Piece]]] = {}
    for key, shape, dtype, piece in records:
        known = by_key.setdefault(key, (shape, dtype, []))
        if (known[0], known[1]) != (shape, dtype):
            raise ValueError(f"ranks disagree on {describe(key)}: {known[:2]} vs {(shape, dtype)}")
        known[2].append(piece)
    tensors = []
    for key, (shape, dtype, pieces) in by_key.items():
        pieces.sort(key=lambda p: p.start)
        _check_cover(key, TensorInfo(shape, parse_dtype(dtype, "index")), pieces)
        tensors.append({"key": list(key), "shape": list(shape), "dtype": dtype,
                        "pieces": [{"file": p.file, "offset": p.offset, "start": p.start,
                                    "stop": p.stop, "crc32": p.crc32} for p in pieces]})
    all_files: dict[str, dict[str, int]] = {name: {"bytes": n} for name, n in files.items()}
    all_files[OBJECTS] = {"bytes": objects[0], "crc32": objects[1]}
    return {"format": SHARDED, "version": VERSION, "byteorder": sys.byteorder, "data": data,
            "world_size": world_size, "strategy": strategy, "torch": str(torch.__version__),
            "entries": [meta.to_json(name) for name, meta in entries.items()],
            "tensors": tensors, "files": all_files}


def _check_cover(key: Key, info: TensorInfo, pieces: list[Piece]) -> None:
    """Pieces (sorted by start) must tile ``[0, numel)`` exactly."""
    at = 0
    for p in pieces:
        if p.start != at or p.stop < p.start:
            raise CorruptCheckpointError(
                f"the pieces of {describe(key)} leave a gap or overlap at element {at} "
                f"(a piece covers {p.start}-{p.stop})")
        at = p.stop
    if at != info.numel:
        raise CorruptCheckpointError(f"the pieces of {describe(key)} cover {at} of its "
                                     f"{info.numel} elements")


def _file_name(name: Any, where: str) -> str:
    """A plain file name inside the checkpoint (an index never points elsewhere)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (
            ".", ".."):
        raise CorruptCheckpointError(f"{where}: {name!r} is not a file name inside the checkpoint")
    return name


def _need(obj: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptCheckpointError(f"{where}: field {name!r} is missing or malformed; the "
                                     "checkpoint index is corrupted, load another checkpoint")
    return value


def decode(path: Path) -> Index:
    """Parse and check ``path`` (a marker file); raises :class:`CorruptCheckpointError`."""
    where = str(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{where} is not readable JSON ({err}); the checkpoint "
                                     "index is corrupted") from err
    try:
        return _decode(doc, where)
    except (TypeError, ValueError, AttributeError) as err:  # fields of the wrong type
        raise CorruptCheckpointError(f"{where} is malformed ({err}); the checkpoint index is "
                                     "corrupted") from err


def _decode(doc: Any, where: str) -> Index:
    if not isinstance(doc, dict) or doc.get("format") != SHARDED:
        raise CorruptCheckpointError(f"{where} is not the index of a metadist sharded checkpoint")
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(f"{where} has format version {doc.get('version')!r}; this "
                                     f"metadist reads version {VERSION}: upgrade metadist")
    if doc.get("byteorder") != sys.byteorder:
        raise CorruptCheckpointError(f"{where} was written on a {doc.get('byteorder')}-endian "
                                     f"machine; this one is {sys.byteorder}-endian")
    entries: dict[str, EntryMeta] = {}
    for e in _need(doc, "entries", list, where):
        kind = _need(e, "kind", str, where)
        if kind not in KINDS:
            raise CorruptCheckpointError(f"{where}: unknown entry kind {kind!r}")
        entries[_need(e, "name", str, where)] = EntryMeta(
            kind, [str(k) for k in e.get("keys", [])],
            {str(a): str(b) for a, b in dict(e.get("aliases", {})).items()},
            [tuple(int(d) for d in s) for s in e.get("shapes", [])])
    tensors: dict[Key, tuple[TensorInfo, list[Piece]]] = {}
    for t in _need(doc, "tensors", list, where):
        key = tuple(str(k) for k in _need(t, "key", list, where))
        info = TensorInfo(tuple(int(d) for d in _need(t, "shape", list, where)),
                          parse_dtype(t.get("dtype"), where))
        pieces = [Piece(_file_name(p.get("file"), where), _need(p, "offset", int, where),
                        _need(p, "start", int, where), _need(p, "stop", int, where),
                        _need(p, "crc32", int, where)) for p in _need(t, "pieces", list, where)]
        pieces.sort(key=lambda p: p.start)
        _check_cover(key, info, pieces)
        tensors[key] = (info, pieces)
    files = _need(doc, "files", dict, where)
    objects = _need(files, OBJECTS, dict, where)
    return Index(
        data=_file_name(doc.get("data"), where), world_size=_need(doc, "world_size", int, where),
        strategy=str(doc.get("strategy", "?")), entries=entries, tensors=tensors,
        files={_file_name(n, where): _need(f, "bytes", int, where) for n, f in files.items()
               if n != OBJECTS},
        objects_bytes=_need(objects, "bytes", int, where),
        objects_crc32=_need(objects, "crc32", int, where))
