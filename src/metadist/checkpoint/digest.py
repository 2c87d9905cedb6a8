"""Whole-file SHA-256 digests: a load checks every byte it trusts before parsing any of it.

Per-tensor CRCs leave the rest of a file unprotected (plain values, hyperparameters, RNG
states, the index itself), and torch's zip reader does not check its own CRCs: one changed
byte could load as a silently different state. So each file whose bytes a load parses
carries a digest of all its bytes, and the digest's own bytes are checked exactly:

* the full format's zip (from ``torch.save``) carries it as the archive comment, after the
  end-of-central-directory record, which zip readers (torch's included) ignore:
  ``sha256(file minus comment) == comment``; it is computed while the file is written;
* the sharded format's ``metadata.json`` ends with a ``"sha256"`` field, the digest of every
  byte before that field; the index records the CRC-32 of ``objects.pt`` and of every piece
  of every data file, and each data file's size, so its digest covers all the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from metadist.checkpoint.errors import CorruptCheckpointError

_ZIP_MAGIC = b"metadist-sha256:"
_ZIP_TRAILER = len(_ZIP_MAGIC) + 64  # the comment: magic + hex digest
_EOCD = b"PK\x05\x06"  # end of central directory: 22 bytes, its last 2 the comment length
_JSON_OPEN = b',\n "sha256": "'
_JSON_CLOSE = b'"\n}\n'
_JSON_TRAILER = len(_JSON_OPEN) + 64 + len(_JSON_CLOSE)
_CHUNK = 8 << 20


def _damaged(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where} fails its sha256 check ({what}): the file is "
                                  "corrupted or truncated; load another checkpoint")


# ----- the full format: a zip archive with the digest as its comment -----------------------

class _Sealer:
    """A write-only stream that hashes what passes through, holding back the last two bytes
    (the archive comment's length, patched when the comment is appended)."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.hash, self.tail = out, hashlib.sha256(), b""
        #: the file system's error, which torch's archive writer (C++) would report only as
        #: "unexpected pos" (a full disk, a quota)
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n >= 2:
            self._emit(self.tail)
            self._emit(view[:-2])
            self.tail = bytes(view[-2:])
        else:
            joined = self.tail + bytes(view)
            self._emit(joined[:-2])
            self.tail = joined[-2:]
        return n

    def _emit(self, data: bytes | memoryview) -> None:
        if len(data):
            self.hash.update(data)
            try:
                self.out.write(data)
            except OSError as err:
                self.error = self.error or err
                raise

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        if self.tail != b"\x00\x00":
            raise ValueError("torch.save did not end its archive with an empty comment; "
                             "this torch version is not supported by metadist checkpoints")
        self._emit(struct.pack("<H", _ZIP_TRAILER))
        self.out.write(_ZIP_MAGIC + self.hash.hexdigest().encode())


def write_sealed_zip(out: IO[bytes], save: Callable[[IO[bytes]], object]) -> None:
    """Run ``save(stream)`` (a ``torch.save``) into ``out``, digesting it on the way."""
    sealer = _Sealer(out)
    try:
        save(sealer)  # type: ignore[arg-type]  # write() and flush() are all torch uses
    except Exception as exc:
        if sealer.error is not None:  # what the file system said, not torch's "unexpected pos"
            raise sealer.error from exc
        raise
    sealer.close()


def verify_zip(path: Path) -> bool | None:
    """Check ``path``'s digest: True when it carries a correct one, None when it carries
    none (written before digests), False when its bytes differ from those saved."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _ZIP_TRAILER + len(_EOCD) + 18:
                return None
            f.seek(size - _ZIP_TRAILER)
            trailer = f.read(_ZIP_TRAILER)
            if not trailer.startswith(_ZIP_MAGIC):
                return None
            hasher, left = hashlib.sha256(), size - _ZIP_TRAILER
            f.seek(0)
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    return False  # shrank while being read
                hasher.update(chunk)
                left -= len(chunk)
    except OSError as err:
        raise CorruptCheckpointError(f"cannot read {path}: {err}") from err
    return trailer[len(_ZIP_MAGIC):] == hasher.hexdigest().encode()


# ----- the sharded format's index: JSON ending in its digest -------------------------------

def seal_json(doc: dict[str, Any]) -> bytes:
    """``doc`` as indented JSON whose last field, ``"sha256"``, is the digest of every byte
    before it (``doc`` itself must not have that key)."""
    assert "sha256" not in doc
    head = json.dumps(doc, indent=1).encode()
    assert head.endswith(b"\n}")
    head = head[:-2]
    return head + _JSON_OPEN + hashlib.sha256(head).hexdigest().encode() + _JSON_CLOSE


def verify_json(raw: bytes, where: str) -> bool:
    """Check a sealed index: True when its digest is correct, False when it has none
    (written before digests); raises :class:`CorruptCheckpointError` otherwise."""
    if len(raw) < _JSON_TRAILER or b'"sha256"' not in raw[-_JSON_TRAILER:]:
        return False
    head, tail = raw[:-_JSON_TRAILER], raw[-_JSON_TRAILER:]
    expected = _JSON_OPEN + hashlib.sha256(head).hexdigest().encode() + _JSON_CLOSE
    if tail != expected:
        raise _damaged(where, "its bytes differ from those saved")
    return True
