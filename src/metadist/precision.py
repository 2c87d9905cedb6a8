"""Precision policies and the rank-synchronised loss scaler.

``metadist.strategy(name, precision=...)`` picks one of four modes:

* ``"32-true"``: everything in float32 (the default).
* ``"bf16-mixed"``: the forward runs under autocast to bfloat16; parameters, gradients and
  optimizer state stay float32 ("master weights"). Runs on CPU (autocast CPU) and on GPUs
  with bfloat16 support.
* ``"16-mixed"``: as above with float16, plus a dynamic :class:`LossScaler` so small
  gradients do not underflow. Its inf/NaN check is all-reduced over every rank: a sharded
  optimizer only sees its own shard, and a rank that skipped alone would desynchronise the
  replicas (the problem FairScale's ShardedGradScaler exists for).
* ``"bf16-true"``: parameters, gradients and optimizer state in bfloat16, no master copy
  (half the memory, less accurate).

Mixed and true modes return the forward's floating outputs in float32, so losses are
computed at full precision.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from metadist.comm import ops

MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
#: Other libraries' names for the same modes (Betty's ``Config(precision=...)``).
ALIASES = {"fp32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16`` (dtypes and None pass through)."""
    if value is None or isinstance(value, torch.dtype):
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
                x = torch.ones(2, 2, device=device_type)
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


class LossScaler:
    """Dynamic loss scaling whose skip decision is the same on every rank.

    ``scale(loss)`` multiplies the loss before backward. Before ``optimizer.step()`` the
    scaler divides this rank's gradients (those of the tensors the optimizer steps: its shard
    under zero1/2/3) by the scale, checks them for inf/NaN and all-reduces that flag. If any
    rank saw one, every rank skips the step (gradients are set to None, so the optimizer
    leaves parameters and state untouched) and the scale backs off; after
    ``growth_interval`` clean steps in a row it grows.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1
                and init_scale > 0):
            raise ValueError("LossScaler needs init_scale > 0, growth_factor > 1, "
                             "0 < backoff_factor < 1 and growth_interval >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # clean steps since the last change
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._scaled = False  # a scaled backward happened since the last step
        self._unscaled = False  # this step's gradients are already divided by the scale

    # ----- the step ----------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self._scaled = True
        return loss * self.scale_value

    def current_scale(self) -> float:
        """The factor gradients carry right now (1.0 once unscaled)."""
        return 1.0 if self._unscaled else self.scale_value

    @staticmethod
    def _grads(optimizer: Optimizer) -> list[torch.Tensor]:
        return [p.grad for g in optimizer.param_groups for p in g["params"]
                if p.grad is not None]

    @torch.no_grad()
    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide this step's gradients by the scale (idempotent within a step)."""
        if self._unscaled:
            return
        grads = self._grads(optimizer)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale_value)
        self._unscaled = True

    @torch.no_grad()
    def _found_inf(self, optimizer: Optimizer) -> bool:
        grads = self._grads(optimizer)
        # max-abs norms are inf/NaN exactly when a gradient holds one; one pass per tensor
        local = (not all(torch.isfinite(n).item() for n in torch._foreach_norm(grads, float("inf")))
                 if grads else False)
        flag = torch.tensor([1.0 if local else 0.0])
        ops.all_reduce(flag, "max")
        return bool(flag.item() > 0)

    def before_step(self, optimizer: Optimizer) -> None:
        """Unscale, check every rank for inf/NaN and drop this step's gradients if any saw
        one; run before ``optimizer.step()`` on synchronised gradients (the strategy's step
        chain runs it in its ``"unscale"`` phase)."""
        if not self._scaled:
            raise RuntimeError(
                "precision='16-mixed' scales the loss in strategy.backward(loss), but this "
                "step's gradients came from a plain loss.backward(); call "
                "strategy.backward(loss) (or scaler.scale(loss).backward())")
        self.unscale_(optimizer)
        self.last_step_skipped = self._found_inf(optimizer)
        if self.last_step_skipped:
            for g in optimizer.param_groups:
                for p in g["params"]:
                    p.grad = None  # torch optimizers skip parameters without a gradient

    def after_step(self) -> None:
        """Grow or back off the scale after ``optimizer.step()`` (skipped or not)."""
        self._update(self.last_step_skipped)
        self._scaled = self._unscaled = False

    def _update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.growth_tracker = 0

    @contextmanager
    def unscaled(self, optimizer: Optimizer) -> Iterator[None]:
        """Gradients divided by the scale inside the block (e.g. to inspect them)."""
        self.unscale_(optimizer)
        yield

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state lacks {sorted(missing)}; pass the dict saved "
                             "by LossScaler.state_dict()")
        self.scale_value = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.scale_value:g}, growth_tracker={self.growth_tracker}, "
                f"skipped_steps={self.skipped_steps})")
