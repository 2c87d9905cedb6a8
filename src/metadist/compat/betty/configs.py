"""Betty's ``Config`` and ``EngineConfig``: Betty's field names and defaults, Betty's meaning.

Where a Betty value cannot mean the same here, construction raises and says what to write
instead; nothing is accepted and then ignored silently (the fields that only steer Betty's
own machinery are listed in :data:`NO_EFFECT` with the reason they need nothing here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metadist.compat.betty.hypergradient import BETTY_TYPES
from metadist.precision import canonical as canonical_precision
from metadist.strategies.registry import available
from metadist.strategies.registry import canonical as canonical_strategy

TYPES = tuple(BETTY_TYPES)  # Betty's names of the best-response methods

#: Fields that change nothing here, and why.
NO_EFFECT = {
    "retain_graph": "every hypergradient term re-evaluates the losses it needs",
    "backend": "the backend follows the device (gloo on CPU, NCCL on GPU)",
}


@dataclass
class Config:
    """One problem's configuration (Betty's ``betty.configs.Config``).

    ``type`` is the method for the best-response Jacobian of *this* problem (used by its
    upper problems); ``first_order`` on an *upper* problem turns its hypergradient through
    its lower problems on (True, Betty's default) or off. ``gradient_clipping`` 0.0 is off.
    """

    type: str = "darts"
    unroll_steps: int = 1
    first_order: bool = True
    retain_graph: bool = False
    allow_unused: bool = True
    gradient_accumulation: int = 1
    gradient_clipping: float = 0.0
    precision: str = "fp32"
    initial_dynamic_scale: float = 4096.0
    scale_factor: float = 2.0
    warmup_steps: int = 0
    log_step: int = -1
    log_local_step: bool = False
    darts_alpha: float = 0.01
    darts_multitask: bool = False
    sama_adam_alpha: float = 1.0
    sama_multitask: bool = False
    neumann_iterations: int = 1
    neumann_alpha: float = 1.0
    cg_iterations: int = 1
    cg_alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"Config(type={self.type!r}) is not known; choose one of: "
                             f"{', '.join(TYPES)}")
        canonical_precision(self.precision)  # raises, listing the valid names
        if self.darts_multitask or self.sama_multitask:
            raise ValueError("Config(darts_multitask/sama_multitask=True) leaves the lower "
                             "problem's parameters moved by the finite difference after each "
                             "hypergradient; it is not supported: leave it False")
        for name in ("unroll_steps", "gradient_accumulation"):
            if getattr(self, name) < 1:
                raise ValueError(f"Config({name}={getattr(self, name)}) must be >= 1")
        if self.gradient_clipping < 0:
            raise ValueError(f"Config(gradient_clipping={self.gradient_clipping}) must be >= 0 "
                             "(0.0: off)")

    # ----- what metadist's own engine reads ---------------------------------------------------
    @property
    def method(self) -> str:
        """The registered metadist method computing ``type`` (Betty's darts is gF - M.v:
        native sama with the identity preconditioner, not native DARTS' virtual step)."""
        return BETTY_TYPES[self.type].method


@dataclass
class EngineConfig:
    """The engine's configuration (Betty's ``betty.configs.EngineConfig``). ``strategy``
    takes Betty's names ("default", "distributed", "zero", "fsdp") and metadist's.

    One field Betty does not have: ``strategy_options``, metadist's options of the strategy
    (e.g. ``{"sync_batchnorm": True}``, BatchNorm statistics over the global batch, which
    makes N ranks equal one process; ``{"min_unit_params": ...}`` for "fsdp"). It is the
    one line to add to a Betty program for them; everything else stays Betty's API."""

    train_iters: int = 50000
    valid_step: int = 500
    logger_type: str = "none"
    roll_back: bool = False
    backend: str = "nccl"
    strategy: str = "default"
    early_stopping: bool = False
    early_stopping_mode: str = "min"
    early_stopping_tolerance: int = 5
    early_stopping_metric: str = "loss"
    strategy_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if canonical_strategy(self.strategy) not in available():
            raise ValueError(f"EngineConfig(strategy={self.strategy!r}) is not known; choose "
                             f"one of: {', '.join(available())}")
        if self.logger_type not in ("none", "tensorboard", "wandb"):
            raise ValueError(f"EngineConfig(logger_type={self.logger_type!r}) is not known; "
                             "choose one of: none, tensorboard, wandb")
        if self.early_stopping_mode not in ("min", "max"):
            raise ValueError(f"EngineConfig(early_stopping_mode={self.early_stopping_mode!r}) "
                             "is not known; choose one of: min, max")
