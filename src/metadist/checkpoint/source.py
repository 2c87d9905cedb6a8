"""A checkpoint opened for reading, in either format, as one logical view.

Whatever wrote it (strategy, world size, format), a checkpoint is read as: entries (name ->
kind), logical tensors by :data:`~metadist.checkpoint.entries.Key` with their full shape and
dtype, of which any element range can be read; small values (scalars, non-tensors);
optimizer hyperparameters; stateful objects' states; plain values; every rank's RNG state.
Opening reads only metadata, after checking its digest; tensor bytes are read on demand
(the full format is mapped with ``mmap``), so each rank reads just what it will hold (a full
file is read once more, whole, to check its digest before torch parses it).
"""

from __future__ import annotations

import io
import zlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from metadist.checkpoint.digest import verify_zip
from metadist.checkpoint.entries import HEADER, KINDS, Key, describe, is_piece_tensor, plain_copy
from metadist.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from metadist.checkpoint.index import (
    FULL,
    LEGACY_VERSION,
    MARKER,
    OBJECTS,
    VERSION,
    EntryMeta,
    check_keys,
    check_layout,
    decode,
)
from metadist.checkpoint.pieces import Piece, PieceReader, TensorInfo, assemble, checksum


class Source(ABC):
    """The logical contents of a checkpoint (see the module docstring)."""

    def __init__(self, path: Path, format: str) -> None:
        self.path, self.format = path, format
        self.world_size = 1
        self.strategy = "?"
        self.entries: dict[str, EntryMeta] = {}
        self.tensors: dict[Key, TensorInfo] = {}
        self.values: dict[Key, Any] = {}
        self.param_groups: dict[str, list[dict[str, Any]]] = {}
        self.stateful: dict[str, Any] = {}
        self.plain: dict[str, Any] = {}
        self.rng: list[dict[str, Any]] = []

    @abstractmethod
    def read(self, key: Key, start: int, stop: int, out: torch.Tensor) -> None:
        """Fill 1-D ``out`` with elements ``[start, stop)`` of flattened tensor ``key``."""

    def close(self) -> None:  # noqa: B027 (optional: only some sources hold files)
        """Release open files."""

    def value(self, key: Key) -> Any:
        """Value ``key`` (a 0-dim tensor, a number, an object), a copy of its own for each
        reader. Values saved from one tensor (a flat shard's step count, saved once per
        parameter it holds) come back sharing storage; handed out as they are, an
        optimizer stepping each parameter would advance the shared count once per
        parameter, silently."""
        return plain_copy(self.values[key], private=True)

    def full(self, key: Key) -> torch.Tensor:
        """The whole tensor ``key``, in its saved shape and dtype."""
        info = self.tensors[key]
        out = torch.empty(info.numel, dtype=info.dtype)
        self.read(key, 0, info.numel, out)
        return out.view(info.shape)

    def module_key(self, name: str, key: str) -> Key:
        """Where module ``name``'s state-dict key ``key`` is stored (tied names resolved)."""
        stored = self.entries[name].aliases.get(key, key)
        return (name, stored)

    def optimizer_state(self, name: str) -> dict[int, list[str]]:
        """Optimizer ``name``'s state names per parameter index."""
        out: dict[int, list[str]] = {}
        for key in [*self.tensors, *self.values]:
            if len(key) == 3 and key[0] == name:
                out.setdefault(int(key[1]), []).append(key[2])
        return {i: sorted(names) for i, names in sorted(out.items())}

    def _take_objects(self, objects: Any) -> None:
        """Values, hyperparameters, stateful states, plain values and RNG from ``objects``."""
        if not isinstance(objects, dict):
            raise CorruptCheckpointError(f"{self.path}: the objects record is not a dict")
        self.values.update(objects.get("values", {}))
        self.param_groups.update(objects.get("param_groups", {}))
        self.stateful.update(objects.get("stateful", {}))
        self.plain.update(objects.get("plain", {}))
        self.rng = list(objects.get("rng", []))


def _load_torch(source: io.BytesIO | Path, where: str, mmap: bool = False) -> Any:
    """``torch.load`` that never unpickles arbitrary objects; every failure names the file."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, foreign pickle, refused global, ...
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        # weights_only errors put the useful line ("Unsupported global: ...") further down
        first = next((line for line in lines if "Unsupported" in line),
                     lines[0] if lines else type(err).__name__)
        # torch goes on to suggest allowlisting the global: never the advice for a file that
        # metadist did not write (it would run whatever the pickle names).
        refused = "Unsupported global" in first
        first = first.split(". Please use", 1)[0].split(" Please use", 1)[0]
        hint = ("; it holds a Python object outside the weights-only allowlist, which metadist "
                "never unpickles: it was not written by strategy.save, do not allowlist the "
                "global unless you wrote the file yourself" if refused else
                "; it is truncated, corrupted or not a metadist checkpoint")
        raise CorruptCheckpointError(
            f"{where} cannot be read as a checkpoint ({type(err).__name__}: {first}){hint}"
        ) from err


class ShardedSource(Source):
    """A directory: ``metadata.json`` (the marker and index) and a version directory of
    per-rank data files plus ``objects.pt``."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "sharded")
        marker = path / MARKER
        if not marker.is_file():
            raise IncompleteCheckpointError(
                f"{path} holds no complete checkpoint: its marker {MARKER} is missing (the save "
                "that wrote it was interrupted, or this is not a metadist checkpoint); load an "
                "earlier checkpoint")
        index = decode(marker)
        data = path / index.data
        if not data.is_dir():
            raise CorruptCheckpointError(f"{marker} names the data directory {data}, which is "
                                         "missing; the checkpoint was partly deleted")
        self.world_size, self.strategy, self.entries = (index.world_size, index.strategy,
                                                        index.entries)
        self._pieces: dict[Key, list[Piece]] = {}
        for key, (info, pieces) in index.tensors.items():
            self.tensors[key], self._pieces[key] = info, pieces
        objects_path = data / OBJECTS
        try:
            blob = objects_path.read_bytes()
        except OSError as err:
            raise CorruptCheckpointError(f"cannot read {objects_path}: {err}") from err
        if len(blob) != index.objects_bytes or zlib.crc32(blob) != index.objects_crc32:
            raise CorruptCheckpointError(f"{objects_path} fails its size/checksum check: the file "
                                         "is truncated or corrupted; load another checkpoint")
        self._take_objects(_load_torch(io.BytesIO(blob), str(objects_path)))
        check_keys([*self.tensors, *self.values], self.entries, str(marker))
        self._check_present(str(marker))
        check_layout(index, str(marker))
        self._reader = PieceReader(data, index.files)

    def _check_present(self, where: str) -> None:
        """Every key a module entry lists must have its tensor or value stored."""
        for name, meta in self.entries.items():
            for key in meta.keys if meta.kind == "module" else []:
                stored = self.module_key(name, key)
                if stored not in self.tensors and stored not in self.values:
                    raise CorruptCheckpointError(
                        f"{where}: {describe((name, key))} is listed but missing from the "
                        "checkpoint (neither its tensor nor its value is stored); the "
                        "checkpoint is corrupted, load another checkpoint")

    def read(self, key: Key, start: int, stop: int, out: torch.Tensor) -> None:
        assemble(key, self.tensors[key], self._pieces[key], self._reader, start, stop, out)

    def close(self) -> None:
        self._reader.close()


class FullSource(Source):
    """One file from ``torch.save``: the user's entry names at the top level (modules as state
    dicts, optimizers in the plain format, ...) and metadist's header under ``"metadist"``."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "full")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as err:
            raise CorruptCheckpointError(f"cannot read {path}: {err}") from err
        if magic != b"PK\x03\x04":
            raise CorruptCheckpointError(
                f"{path} is not a metadist checkpoint: it is not a zip archive as torch.save "
                "writes (an older torch pickle, or another kind of file); load a file saved "
                "by strategy.save(..., format='full')")
        sealed = verify_zip(path)  # every byte, before torch parses any of them
        if sealed is False:
            raise CorruptCheckpointError(
                f"{path} fails its sha256 check: {_damaged_tensor(path)}; the file is "
                "corrupted or truncated, load another checkpoint")
        doc = _load_torch(path, str(path), mmap=True)
        header = doc.get(HEADER) if isinstance(doc, dict) else None
        if not isinstance(header, dict) or header.get("format") != FULL:
            raise CorruptCheckpointError(
                f"{path} is not a metadist checkpoint (it has no {HEADER!r} header); save "
                "checkpoints with strategy.save, or load this file with torch.load yourself")
        version = header.get("version")
        if version not in (VERSION, LEGACY_VERSION):
            raise CorruptCheckpointError(f"{path} has format version {version!r}; this "
                                         f"metadist reads version {VERSION}: upgrade metadist")
        if sealed is None and version != LEGACY_VERSION:
            raise CorruptCheckpointError(
                f"{path} lacks its sha256 digest, which format version {version!r} requires: "
                "the file is corrupted or truncated; load another checkpoint")
        self._data: dict[Key, torch.Tensor] = {}
        self._crc: dict[Key, int] = dict(header.get("crc32", {}))
        self._verified: set[Key] = set()
        try:
            self._parse(doc, header)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptCheckpointError(f"{path} is malformed ({type(err).__name__}: {err}); "
                                         "the checkpoint is corrupted") from err

    def _parse(self, doc: dict[str, Any], header: dict[str, Any]) -> None:
        self.world_size = int(header.get("world_size", 1))
        self.strategy = str(header.get("strategy", "?"))
        self.rng = list(header.get("rng", []))
        for name, meta in header["entries"].items():
            kind = meta["kind"]
            if kind not in KINDS:
                raise ValueError(f"unknown entry kind {kind!r}")
            value = doc[name]
            entry = EntryMeta(kind, shapes=[tuple(s) for s in meta.get("shapes", [])])
            self.entries[name] = entry
            match kind:
                case "module":
                    entry.keys = list(value)
                    for key, v in value.items():
                        self._add((name, key), v)
                case "optimizer":
                    groups = value["param_groups"]
                    order = [pid for g in groups for pid in g["params"]]
                    position = {pid: i for i, pid in enumerate(order)}
                    start, normal = 0, []
                    for g in groups:
                        count = len(g["params"])
                        normal.append({**g, "params": list(range(start, start + count))})
                        start += count
                    self.param_groups[name] = normal
                    for pid, state in value["state"].items():
                        for state_name, v in state.items():
                            self._add((name, str(position[pid]), state_name), v)
                case "stateful":
                    self.stateful[name] = value
                case _:
                    self.plain[name] = value

    def _add(self, key: Key, value: Any) -> None:
        if is_piece_tensor(value):
            self.tensors[key] = TensorInfo(tuple(value.shape), value.dtype)
            self._data[key] = value
        else:
            self.values[key] = value

    def read(self, key: Key, start: int, stop: int, out: torch.Tensor) -> None:
        t = self._data[key]
        if key not in self._verified and key in self._crc:
            if checksum(t) != self._crc[key]:
                raise CorruptCheckpointError(f"{self.path}: the bytes of {describe(key)} fail "
                                             "their checksum: the file is corrupted")
            self._verified.add(key)
        out.copy_(t.reshape(-1)[start:stop])


def _damaged_tensor(path: Path) -> str:
    """Which tensor a digest failure lies in, if the per-tensor CRC-32s can tell (the file
    is parsed only to word the message; nothing from it is used)."""
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        header = doc[HEADER]
        source = FullSource.__new__(FullSource)
        Source.__init__(source, path, "full")
        source._data, source._crc = {}, dict(header["crc32"])
        source._parse(doc, header)
        for key, t in source._data.items():
            if key in source._crc and checksum(t) != source._crc[key]:
                return f"the bytes of {describe(key)} fail their checksum"
    except Exception:  # too damaged to parse: say so
        return "its bytes differ from those saved, in the archive's structure"
    return ("its bytes differ from those saved, outside tensor data (the header, a plain value, "
            "a hyperparameter or a state)")


def open_source(path: Path) -> Source:
    """Open the checkpoint at ``path``: a directory is sharded, a file is full."""
    if path.is_dir():
        return ShardedSource(path)
    if path.is_file():
        return FullSource(path)
    if not path.exists():
        raise CheckpointError(f"there is no checkpoint at {path}; check the path (save one "
                              "with strategy.save first)")
    raise CheckpointError(f"{path} is neither a checkpoint file nor a checkpoint directory")
