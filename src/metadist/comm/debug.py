"""Debug mode: before each collective, every rank of the group compares a fingerprint of it.

The fingerprint (call number on the group, op, reduce op, root, and the dtype and shape of the
tensors that must agree) is a fixed-length int64 vector, so the exchange itself lines up
however the ranks' calls differ: one small all-gather per collective. A mismatch raises
:class:`~metadist.errors.CollectiveMismatchError` on every rank, naming the op, the field that
differs and which ranks hold which value. Off by default (``METADIST_DEBUG=1``,
``metadist.init(debug=True)`` or ``comm.set_debug(True)``); benchmarks/comm.py ``--debug``
measures the cost.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from metadist.errors import CollectiveMismatchError
from metadist.runtime.tracker import CollectiveCall, compact_ranks

MAX_DIMS = 8
MAX_TENSORS = 2
_SPEC = 2 + MAX_DIMS  # dtype, ndim, dims
WIDTH = 5 + MAX_TENSORS * _SPEC

TensorSpec = tuple[torch.Tensor, bool]
"""A tensor whose dtype must agree across ranks, and whether its shape must agree too."""


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "scatter", "gather",
        "all_to_all", "barrier", "broadcast_object", "gather_object", "all_gather_object")
_NAMES: dict[int, str] = {_code(n): n for n in (*_OPS, "sum", "mean", "max", "min", "prod")}
_NAMES.update({_code(str(d)): str(d).removeprefix("torch.")
               for d in vars(torch).values() if isinstance(d, torch.dtype)})


def _name(code: int) -> str:
    return "" if code == 0 else _NAMES.get(code, f"<{code}>")


def encode(seq: int, op: str, reduce: str, root: int, specs: Sequence[TensorSpec]) -> list[int]:
    """This rank's fingerprint of one collective."""
    row = [seq, _code(op), _code(reduce) if reduce else 0, root, len(specs)]
    for tensor, shaped in list(specs)[:MAX_TENSORS]:
        dims = list(tensor.shape) if shaped else []
        if len(dims) > MAX_DIMS:  # keep the first dims readable, fold the rest into a hash
            dims = [*dims[: MAX_DIMS - 1], _code(str(dims[MAX_DIMS - 1:]))]
        row += [_code(str(tensor.dtype)), tensor.dim() if shaped else -1]
        row += dims + [-1] * (MAX_DIMS - len(dims))
    return row + [0] * (WIDTH - len(row))


@dataclass(frozen=True)
class Fingerprint:
    """A decoded fingerprint: the fields a message can name."""

    op: str
    seq: int
    reduce: str
    root: int
    dtypes: tuple[str, ...]
    shapes: tuple[str, ...]


def decode(row: Sequence[int]) -> Fingerprint:
    dtypes, shapes = [], []
    for i in range(min(row[4], MAX_TENSORS)):
        spec = row[5 + i * _SPEC: 5 + (i + 1) * _SPEC]
        dtypes.append(_name(spec[0]))
        ndim = spec[1]
        dims = [str(d) for d in spec[2: 2 + min(max(ndim, 0), MAX_DIMS)]]
        shapes.append("(any)" if ndim < 0 else f"({', '.join(dims)}{',' if ndim == 1 else ''})")
    return Fingerprint(_name(row[1]), row[0], _name(row[2]) or "-", row[3], tuple(dtypes),
                       tuple(shapes))


_FIELDS: tuple[tuple[str, Callable[[Fingerprint], object]], ...] = (
    ("op", lambda f: f.op),
    ("call number on the group", lambda f: f.seq),
    ("reduce op", lambda f: f.reduce),
    ("root (src/dst group rank)", lambda f: "-" if f.root < 0 else f.root),
    ("dtype", lambda f: ", ".join(f.dtypes) or "-"),
    ("shape", lambda f: ", ".join(f.shapes) or "-"),
)


def describe(entry: CollectiveCall, rows: list[list[int]], me: int) -> CollectiveMismatchError:
    """The error every rank raises for differing ``rows`` (one per group rank)."""
    ranks = entry.group.ranks
    prints = [decode(row) for row in rows]
    counts = Counter(tuple(row) for row in rows).most_common()
    tied = len(counts) > 1 and counts[0][1] == counts[1][1]
    reference = tuple(rows[0]) if tied else counts[0][0]
    culprit = next(ranks[i] for i, row in enumerate(rows) if tuple(row) != reference)
    parts = []
    # Different ops naturally differ in reduce op and root too: name the op alone then.
    fields = _FIELDS[:2] if len({fp.op for fp in prints}) > 1 else _FIELDS
    for field, get in fields:
        values: dict[object, list[int]] = {}
        for i, fp in enumerate(prints):
            values.setdefault(get(fp), []).append(ranks[i])
        if len(values) > 1:
            held = "; ".join(
                f"{value} on rank{'s' if len(rs) > 1 else ''} {compact_ranks(rs)}"
                for value, rs in sorted(values.items(), key=lambda kv: kv[1][0]))
            parts.append(f"{field}: {held}")
    message = (
        f"collective mismatch at call #{entry.seq} on {entry.group.label} (rank {me} called "
        f"{entry.op}): the ranks disagree on " + " | ".join(parts) + ". Every rank must issue "
        "the same collectives in the same order with the same dtypes and shapes; this is the "
        f"first call where they differ (rank {culprit}'s traceback shows where it made its "
        "call).")
    return CollectiveMismatchError(message, secondary=me != culprit)


def check(entry: CollectiveCall, pg: Any, size: int, me: int, specs: Sequence[TensorSpec],
          reduce: str, root: int, device: torch.device,
          all_gather: Callable[..., Any]) -> None:
    """Exchange fingerprints of ``entry`` on ``pg``; raise on every rank if they differ.
    ``me`` is this process's global rank."""
    mine = torch.tensor(encode(entry.seq, entry.op, reduce, root, specs), dtype=torch.int64,
                        device=device)
    every = torch.empty(size * WIDTH, dtype=torch.int64, device=device)
    all_gather(every, mine, group=pg)
    rows = every.view(size, WIDTH).tolist()
    if any(row != rows[0] for row in rows):
        raise describe(entry, rows, me)
