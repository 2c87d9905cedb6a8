"""Precision policies and the rank-synchronised loss scaler.

``metadist.strategy(name, precision=...)`` picks one of four modes:

* ``"32-true"``: everything in float32 (the default).
* ``"bf16-mixed"``: the forward runs under autocast to bfloat16; parameters, gradients and
  optimizer state stay float32 ("master weights"). Runs on CPU (autocast CPU) and on GPUs
  with bfloat16 support.
* ``"16-mixed"``: as above with float16, plus a dynamic :class:`LossScaler` so small
  gradients do not underflow. Its inf/NaN check is all-reduced over every rank: a sharded
  optimizer only sees its own shard, and a rank that skipped alone would desynchronise the
  replicas (the problem FairScale's ShardedGradScaler exists for); see metadist/scaler.py.
* ``"bf16-true"``: parameters, gradients and optimizer state in bfloat16, no master copy
  (half the memory, less accurate).

Mixed and true modes return the forward's floating outputs in float32, so losses are
computed at full precision.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from metadist.scaler import LossScaler

__all__ = ["ALIASES", "DTYPES", "MODES", "LossScaler", "Precision", "canonical", "parse_dtype"]

MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
#: Other libraries' names for the same modes (Betty's ``Config(precision=...)``).
ALIASES = {"fp32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16`` (None passes through; a dtype must be a floating
    one: gradients and parameters are reduced and computed in it)."""
    if value is None:
        return value
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f"dtype {value} is not a floating dtype: gradients and parameters "
                             "would be rounded to integers; choose one of: "
                             f"{', '.join(DTYPES)} (or torch.float64)")
        return value
    if value not in DTYPES:
        raise ValueError(f"dtype {value!r} is not known; choose one of: {', '.join(DTYPES)}")
    return DTYPES[value]


def canonical(mode: str) -> str:
    """The mode an alias names (``"fp16"`` -> ``"16-mixed"``); raises on unknown names."""
    name = ALIASES.get(mode, mode)
    if name not in MODES:
        raise ValueError(f"precision {mode!r} is not known; choose one of: "
                         f"{', '.join((*MODES, *ALIASES))}")
    return name


@functools.cache
def _autocast_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch build really autocasts ``device_type`` to ``dtype`` (older CPU
    builds silently disable float16 autocast with a warning)."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.cuda.is_bf16_supported())
        return True
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device_type, dtype=dtype):
                # float32 whatever the default dtype: autocast leaves float64 as it is
                x = torch.ones(2, 2, device=device_type, dtype=torch.float32)
                return (x @ x).dtype == dtype
    except (RuntimeError, ValueError):
        return False


@dataclass(frozen=True)
class Precision:
    """A precision mode bound to a device type (``Precision("bf16-mixed", "cpu")``)."""

    mode: str = "32-true"
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", canonical(self.mode))

    @property
    def compute_dtype(self) -> torch.dtype:
        match self.mode:
            case "bf16-mixed" | "bf16-true":
                return torch.bfloat16
            case "16-mixed":
                return torch.float16
        return torch.float32

    @property
    def mixed(self) -> bool:
        return self.mode.endswith("-mixed")

    def check(self) -> None:
        """Raise if this device cannot run the mode (before any work is done)."""
        if self.mixed and not _autocast_works(self.device_type, self.compute_dtype):
            hint = ("use precision='bf16-mixed' on CPU" if self.device_type == "cpu"
                    else "use precision='16-mixed' on GPUs without bfloat16")
            raise RuntimeError(
                f"precision {self.mode!r} needs {self.compute_dtype} autocast on "
                f"{self.device_type!r}, which this device or torch build does not provide; {hint} "
                "or '32-true'")

    def convert_module(self, module: nn.Module) -> nn.Module:
        """``bf16-true`` keeps parameters and buffers in bfloat16; mixed modes keep float32."""
        if self.mode == "bf16-true":
            return module.to(torch.bfloat16)
        return module

    def autocast(self) -> AbstractContextManager[Any]:
        if self.mixed:
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        return nullcontext()

    def cast_inputs(self, tree: Any) -> Any:
        """``bf16-true``: floating inputs to bfloat16 (the parameters' dtype)."""
        if self.mode != "bf16-true":
            return tree
        return tree_map(lambda t: t.to(torch.bfloat16)
                        if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)

    def cast_outputs(self, tree: Any) -> Any:
        """Floating outputs back to float32 so the loss is computed at full precision."""
        if self.mode == "32-true":
            return tree
        return tree_map(lambda t: t.float()
                        if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
