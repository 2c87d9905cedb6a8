"""The sharded format's index, ``metadata.json``: written last, it is the completion marker.

::

    {"format": "metadist.sharded", "version": 1, "byteorder": "little", "data": "v-<token>",
     "world_size": 2, "strategy": "zero3", "torch": "2.13.0",
     "entries": [{"name": "model", "kind": "module", "keys": [...], "aliases": {...}},
                 {"name": "optimizer", "kind": "optimizer", "shapes": [[16, 10], ...]}, ...],
     "tensors": [{"key": ["model", "inp.weight"], "shape": [16, 10], "dtype": "float32",
                  "pieces": [{"file": "rank-00001.bin", "offset": 0, "start": 80,
                              "stop": 160, "crc32": 1234}, ...]}, ...],
     "files": {"rank-00000.bin": {"bytes": 4096}, "objects.pt": {"bytes": 900, "crc32": 5}},
     "sha256": "<digest of every byte before this field>"}

The digest (:mod:`~metadist.checkpoint.digest`) is checked before anything is parsed; the
index's CRC-32s and sizes then cover every byte of ``objects.pt`` and of the data files.
Version 1 (before digests) indexes carry no digest; they still load, with the other checks.

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

from metadist.checkpoint.digest import verify_json
from metadist.checkpoint.entries import KINDS, Key, Kind, describe
from metadist.checkpoint.errors import CorruptCheckpointError
from metadist.checkpoint.pieces import Piece, PieceRecord, TensorInfo, dtype_from_name, dtype_name

SHARDED = "metadist.sharded"
FULL = "metadist.full"
VERSION = 2
LEGACY_VERSION = 1  # before whole-file digests: loads without one
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
        _check_cover(key, TensorInfo(shape, dtype_from_name(dtype, "index")), pieces, "index")
        tensors.append({"key": list(key), "shape": list(shape), "dtype": dtype,
                        "pieces": [{"file": p.file, "offset": p.offset, "start": p.start,
                                    "stop": p.stop, "crc32": p.crc32} for p in pieces]})
    all_files: dict[str, dict[str, int]] = {name: {"bytes": n} for name, n in files.items()}
    all_files[OBJECTS] = {"bytes": objects[0], "crc32": objects[1]}
    return {"format": SHARDED, "version": VERSION, "byteorder": sys.byteorder, "data": data,
            "world_size": world_size, "strategy": strategy, "torch": str(torch.__version__),
            "entries": [meta.to_json(name) for name, meta in entries.items()],
            "tensors": tensors, "files": all_files}


def _check_cover(key: Key, info: TensorInfo, pieces: list[Piece], where: str) -> None:
    """Pieces (sorted by start) must tile ``[0, numel)`` exactly."""
    at = 0
    files = ", ".join(sorted({p.file for p in pieces})) or "no file"
    for p in pieces:
        if p.start != at or p.stop < p.start:
            raise CorruptCheckpointError(
                f"{where}: the pieces of {describe(key)} in {files} leave a gap or overlap at "
                f"element {at} (a piece covers {p.start}-{p.stop}); the checkpoint index is "
                "corrupted, load another checkpoint")
        at = p.stop
    if at != info.numel:
        raise CorruptCheckpointError(
            f"{where}: the pieces of {describe(key)} in {files} cover {at} of its "
            f"{info.numel} elements (shape {list(info.shape)}); the checkpoint index is "
            "corrupted, load another checkpoint")


def check_keys(keys: list[Key], entries: dict[str, EntryMeta], where: str) -> None:
    """Every stored tensor or value must belong to an entry, in that entry's key form."""
    for key in keys:
        meta = entries.get(key[0]) if key else None
        if meta is None:
            raise CorruptCheckpointError(
                f"{where}: {describe(key)} belongs to {key[0] if key else '?'!r}, but there "
                f"is no such entry (the index lists {', '.join(map(repr, entries))}); the "
                "checkpoint is corrupted, load another checkpoint")
        fits = (len(key) == 2 and key[1] in meta.keys if meta.kind == "module" else
                len(key) == 3 and key[1].isdigit() and int(key[1]) < len(meta.shapes)
                if meta.kind == "optimizer" else False)
        if not fits:
            raise CorruptCheckpointError(
                f"{where}: {describe(key)} is not a key of the {meta.kind} {key[0]!r}; the "
                "checkpoint is corrupted, load another checkpoint")


def check_layout(index: Index, where: str) -> None:
    """The pieces of each data file must tile it from byte 0 to its recorded size: a changed
    dtype, offset or element range shows as a gap or overlap, named by key and file."""
    by_file: dict[str, list[tuple[int, int, Key, TensorInfo, Piece]]] = {
        name: [] for name in index.files}
    for key, (info, pieces) in index.tensors.items():
        for p in pieces:
            if p.file not in by_file:
                raise CorruptCheckpointError(
                    f"{where}: the piece of {describe(key)} is in {p.file!r}, a data file the "
                    "index does not list; the checkpoint index is corrupted")
            if p.offset < 0 or p.start < 0:
                raise CorruptCheckpointError(
                    f"{where}: the piece of {describe(key)} in {p.file} has a negative byte "
                    f"offset ({p.offset}) or first element ({p.start}); the checkpoint index "
                    "is corrupted, load another checkpoint")
            nbytes = (p.stop - p.start) * info.dtype.itemsize
            by_file[p.file].append((p.offset, nbytes, key, info, p))

    def what(key: Key, info: TensorInfo, p: Piece) -> str:
        return f"{describe(key)} ({dtype_name(info.dtype)}, elements {p.start}-{p.stop})"

    for name, placed in by_file.items():
        placed.sort(key=lambda row: (row[0], row[1]))
        at, last = 0, "the start of the file"
        for offset, nbytes, key, info, p in placed:
            if offset != at:
                raise CorruptCheckpointError(
                    f"{where}: in {name}, {last} ends at byte {at} but the piece of "
                    f"{what(key, info, p)} starts at byte {offset}; the checkpoint index is "
                    "corrupted (a changed dtype, offset or element range), load another "
                    "checkpoint")
            at, last = offset + nbytes, f"the piece of {what(key, info, p)}"
        if at != index.files[name]:
            raise CorruptCheckpointError(
                f"{where}: in {name}, {last} ends at byte {at} but the file holds "
                f"{index.files[name]} bytes; the checkpoint index is corrupted (a changed "
                "dtype, offset or element range), load another checkpoint")


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
        raw = path.read_bytes()
    except OSError as err:
        raise CorruptCheckpointError(f"cannot read {where}: {err}") from err
    sealed = verify_json(raw, where)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{where} is not readable JSON ({err}); the checkpoint "
                                     "index is corrupted") from err
    if isinstance(doc, dict) and not sealed and doc.get("version") != LEGACY_VERSION:
        raise CorruptCheckpointError(
            f"{where} lacks its sha256 digest, which format version {doc.get('version')!r} "
            "requires: the file is corrupted or truncated; load another checkpoint")
    try:
        return _decode(doc, where)
    except (TypeError, ValueError, AttributeError) as err:  # fields of the wrong type
        raise CorruptCheckpointError(f"{where} is malformed ({err}); the checkpoint index is "
                                     "corrupted") from err


def _decode(doc: Any, where: str) -> Index:
    if not isinstance(doc, dict) or doc.get("format") != SHARDED:
        raise CorruptCheckpointError(f"{where} is not the index of a metadist sharded checkpoint")
    if doc.get("version") not in (VERSION, LEGACY_VERSION):
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
                          dtype_from_name(t.get("dtype"), where))
        pieces = [Piece(_file_name(p.get("file"), where), _need(p, "offset", int, where),
                        _need(p, "start", int, where), _need(p, "stop", int, where),
                        _need(p, "crc32", int, where)) for p in _need(t, "pieces", list, where)]
        pieces.sort(key=lambda p: p.start)
        _check_cover(key, info, pieces, where)
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
