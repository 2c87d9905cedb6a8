"""Pieces: contiguous element ranges of flattened tensors, stored as raw bytes with a CRC-32.

A rank's data file is the concatenation of its pieces' bytes; the index (JSON) records for
each piece the logical tensor it belongs to (key, full shape, dtype), the element range
``[start, stop)`` of the flattened tensor it covers, its file, byte offset and checksum.
Any slice of any tensor can then be assembled from whichever pieces overlap it, whatever
strategy or world size wrote them. Raw bytes need no unpickling at all to read.
"""

from __future__ import annotations

import ctypes
import os
import zlib
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import Any

import torch

from metadist.checkpoint.entries import Key, describe
from metadist.checkpoint.errors import CorruptCheckpointError


def _buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy. (Tensors do not expose the
    buffer protocol and numpy is optional, so a ctypes array is laid over the memory; the
    caller keeps ``t`` alive while the view is used.)"""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    assert t.device.type == "cpu" and t.is_contiguous()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (torch.load does not verify its own, and mmap skips them)."""
    return zlib.crc32(_buffer(flat_cpu(t)))


def flat_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D CPU tensor (a view when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).contiguous()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, where: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise CorruptCheckpointError(f"{where}: {name!r} is not a torch dtype; the checkpoint "
                                     "is corrupted or from a newer torch")
    return value


@dataclass(frozen=True)
class TensorInfo:
    """A logical tensor: its full shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of a flattened tensor, at byte ``offset`` of ``file``."""

    file: str
    offset: int
    start: int
    stop: int
    crc32: int


@dataclass(frozen=True)
class Slice:
    """What a rank writes: elements ``[start, stop)`` of tensor ``key``, held in ``data``."""

    key: Key
    info: TensorInfo
    start: int
    stop: int
    data: torch.Tensor  # 1-D, stop - start elements


#: a written piece as it travels to rank 0 (plain, picklable): key, shape, dtype, piece
PieceRecord = tuple[Key, tuple[int, ...], str, Piece]


def write_slices(path: Path, slices: list[Slice]) -> list[PieceRecord]:
    """Write every slice's bytes into one new file (fsynced); return their records."""
    records: list[PieceRecord] = []
    offset = 0
    with open(path, "wb") as f:
        for s in slices:
            data = flat_cpu(s.data)
            if data.numel() != s.stop - s.start:
                raise ValueError(f"piece of {describe(s.key)} holds {data.numel()} elements "
                                 f"for the range [{s.start}, {s.stop})")
            view = _buffer(data)
            f.write(view)
            records.append((s.key, s.info.shape, dtype_name(s.info.dtype),
                            Piece(path.name, offset, s.start, s.stop, zlib.crc32(view))))
            offset += view.nbytes
        f.flush()
        os.fsync(f.fileno())
    return records


def _read_exact(f: BufferedReader, offset: int, out: memoryview, name: str) -> None:
    f.seek(offset)
    done = 0
    while done < out.nbytes:  # a single read returns at most ~2 GiB
        n = f.readinto(out[done:])
        if not n:
            raise CorruptCheckpointError(f"{name} ends at byte {offset + done}, before the "
                                         f"{out.nbytes}-byte piece at {offset}: truncated")
        done += n


class PieceReader:
    """Reads and verifies pieces from the data files of one sharded checkpoint."""

    def __init__(self, directory: Path, sizes: dict[str, int]) -> None:
        self.directory, self.sizes = directory, sizes
        self._files: dict[str, BufferedReader] = {}

    def _open(self, name: str) -> BufferedReader:
        f = self._files.get(name)
        if f is None:
            path = self.directory / name
            if name not in self.sizes:
                raise CorruptCheckpointError(f"the index names a data file {name!r} it does not "
                                             f"list in 'files' ({self.directory})")
            try:
                f = open(path, "rb")  # noqa: SIM115 (kept open for the whole load)
            except OSError as err:
                raise CorruptCheckpointError(f"cannot open data file {path}: {err}") from err
            size = os.fstat(f.fileno()).st_size
            if size != self.sizes[name]:
                f.close()
                raise CorruptCheckpointError(
                    f"data file {path} has {size} bytes but the index records "
                    f"{self.sizes[name]}: it was truncated or replaced; load another checkpoint")
            self._files[name] = f
        return f

    def read(self, key: Key, info: TensorInfo, piece: Piece, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous CPU, ``info.dtype``, ``stop - start`` elements) with the
        piece's elements, verifying its checksum."""
        f = self._open(piece.file)
        view = _buffer(out)
        _read_exact(f, piece.offset, view, str(self.directory / piece.file))
        if zlib.crc32(view) != piece.crc32:
            raise CorruptCheckpointError(
                f"{self.directory / piece.file}: the bytes of {describe(key)} (elements "
                f"{piece.start}-{piece.stop}) fail their checksum: the file is corrupted")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def assemble(key: Key, info: TensorInfo, pieces: list[Piece], reader: PieceReader,
             start: int, stop: int, out: torch.Tensor) -> None:
    """Fill ``out`` (1-D, ``stop - start`` elements, any dtype) with elements ``[start, stop)``
    of tensor ``key`` from the pieces that overlap them."""
    covered = 0
    for piece in pieces:
        a, b = max(start, piece.start), min(stop, piece.stop)
        if a >= b:
            continue
        whole = (a, b) == (piece.start, piece.stop)
        if whole and out.dtype == info.dtype and out.is_contiguous() and out.device.type == "cpu":
            reader.read(key, info, piece, out[a - start:b - start])  # straight into place
        else:
            buf = torch.empty(piece.stop - piece.start, dtype=info.dtype)
            reader.read(key, info, piece, buf)
            out[a - start:b - start].copy_(buf[a - piece.start:b - piece.start])
        covered += b - a
    if covered != stop - start:
        raise CorruptCheckpointError(
            f"{reader.directory}: the pieces of {describe(key)} cover {covered} of the "
            f"{stop - start} elements {start}-{stop}: the index is incomplete or corrupted")
