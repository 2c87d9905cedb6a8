"""TorchOpt's ``torchopt.accelerated_op``: its fused Adam step with its numbers and its
hand-written backward (:mod:`.adam_op`). ``is_available`` answers as TorchOpt does where its
compiled kernels do not load (True for devices on which an Adam step runs; False for CUDA
without a GPU)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from metadist.compat.torchopt.accelerated_op.adam_op import AdamOp

__all__ = ["AdamOp", "is_available"]


def is_available(devices: Any = None) -> bool:
    """Whether an accelerated Adam step runs on every one of ``devices`` (default: CUDA and
    CPU)."""
    op = AdamOp()
    listed: Iterable[Any]
    if devices is None:
        listed = [torch.device("cuda"), torch.device("cpu")]
    elif isinstance(devices, torch.device | int | str):
        listed = [devices]
    else:
        listed = devices
    try:
        for name in listed:
            device = torch.device(name)
            if device.type == "cuda" and not torch.cuda.is_available():
                return False
            one = torch.tensor(1.0, device=device)
            op(one, one, one, 1)
        return True
    except Exception:
        return False
