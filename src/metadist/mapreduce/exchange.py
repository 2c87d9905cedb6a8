"""Every rank's bytes on every rank, usually in a single collective.

torch's ``all_gather_object`` runs two collectives (sizes, then padded bytes). Here every rank
sends a region of one fixed capacity holding its payload (or, when it does not fit, only its
length), and one all-gather delivers all of them; on gloo at two ranks metadist's all-gather
is a single exchange (about 0.4 ms here, a third of an all-reduce). An overflow costs one more
round at a capacity every rank derives from the same lengths, and it stays grown for later
calls.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from metadist.comm import ops

_HEADER = 8  # little-endian payload length
_lock = threading.Lock()
_capacity = 1024  # bytes per rank; identical on every rank (only ever changed from shared data)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def exchange(payload: bytes) -> list[bytes]:
    """All ranks' ``payload`` in rank order (collective: every rank must call it)."""
    global _capacity
    world = ops.group_info(None)[1]
    if world == 1:
        return [payload]
    with _lock:
        while True:
            capacity = _capacity
            stride = _HEADER + capacity
            mine = torch.zeros(stride, dtype=torch.uint8)
            mine[:_HEADER] = _bytes_tensor(len(payload).to_bytes(_HEADER, "little"))
            if 0 < len(payload) <= capacity:
                mine[_HEADER:_HEADER + len(payload)] = _bytes_tensor(payload)
            buf = torch.empty(world * stride, dtype=torch.uint8)
            ops.all_gather(buf, mine)
            raw = ctypes.string_at(buf.data_ptr(), buf.numel())  # bytes(storage) is per byte
            lengths = [int.from_bytes(raw[r * stride:r * stride + _HEADER], "little")
                       for r in range(world)]
            if max(lengths) <= capacity:
                return [raw[r * stride + _HEADER:r * stride + _HEADER + n]
                        for r, n in enumerate(lengths)]
            # A payload did not fit. Every rank saw the same lengths, so every rank picks the
            # same larger capacity, and the next round carries everything.
            _capacity = 1 << (max(lengths) - 1).bit_length()
