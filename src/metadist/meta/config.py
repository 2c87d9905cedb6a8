"""Configuration of multilevel problems and of the engine that runs them (frozen dataclasses,
checked on construction so a typo fails before any process group or model is touched)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from metadist.meta.hypergrad import HypergradConfig
from metadist.meta.methods import hypergradient_method
from metadist.precision import Precision
from metadist.strategies.registry import canonical as canonical_strategy

LOGGERS = ("none", "stdout", "tensorboard", "csv")
MODES = ("min", "max")
CHECKPOINT_FORMATS = ("sharded", "full")


@dataclasses.dataclass(frozen=True)
class ProblemConfig:
    """How one problem trains, and how its upper problems' hypergradients pass through it.

    * ``unroll_steps``: optimizer steps this problem takes before its upper problems (``l2u``)
      take one.
    * ``method`` / ``hypergrad``: how an upper problem differentiates through this one's
      response (``"unrolled"``, ``"darts"``, ``"neumann"``, ``"cg"``, ``"sama"``,
      ``"reinforce"`` or a method added with ``metadist.meta.methods.register_hypergradient``)
      and that method's config (:class:`UnrolledConfig`, ...); ``None`` derives it from this
      problem's optimizer: DARTS' ``xi`` and Neumann's ``alpha`` default to its learning
      rate, ``unrolled`` replays its last ``unroll_steps`` steps with ``sgd(lr)``.
      Not Betty's "darts" (gF - M.v at the current weights): that is ``"sama"`` with the
      default :class:`SamaConfig` (see docs/meta-learning.md, "Coming from Betty").
    * ``first_order``: drop the response term: upper problems only get their direct gradient
      at this problem's current parameters (first-order DARTS).
    * ``gradient_accumulation``: micro-batches per optimizer step (losses are averaged).
    * ``gradient_clipping``: max global gradient norm before each step (``None``: off).
    * ``precision``: this problem's precision (``None``: the engine's).
    """

    unroll_steps: int = 1
    method: str = "darts"
    hypergrad: HypergradConfig | None = None
    first_order: bool = False
    gradient_accumulation: int = 1
    gradient_clipping: float | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.unroll_steps < 1:
            raise ValueError(f"ProblemConfig(unroll_steps={self.unroll_steps}): a problem takes "
                             "at least one step per step of its upper problems")
        # raises listing the registered methods, or on a config of another method
        hypergradient_method(self.method).check(self.hypergrad, self.unroll_steps)
        if self.gradient_accumulation < 1:
            raise ValueError(f"gradient_accumulation must be >= 1, got "
                             f"{self.gradient_accumulation}")
        if self.gradient_clipping is not None and self.gradient_clipping <= 0:
            raise ValueError(f"gradient_clipping must be > 0 (or None to disable), got "
                             f"{self.gradient_clipping}")
        if self.precision is not None:  # raises, listing the valid modes; resolves aliases
            object.__setattr__(self, "precision", Precision(self.precision).mode)


@dataclasses.dataclass(frozen=True)
class EarlyStopping:
    """Stop when the validation ``metric`` has not improved by more than ``min_delta`` for
    ``patience`` validations in a row (``mode``: ``"min"`` or ``"max"``)."""

    metric: str = "loss"
    mode: str = "min"
    patience: int = 5
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        match self.mode:
            case "min" | "max":
                pass
            case _:
                raise ValueError(f"early stopping mode {self.mode!r} is not known; choose one "
                                 f"of: {', '.join(MODES)}")
        if self.patience < 1 or self.min_delta < 0:
            raise ValueError(f"EarlyStopping needs patience >= 1 and min_delta >= 0, got "
                             f"patience={self.patience}, min_delta={self.min_delta}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the :class:`~metadist.meta.Engine` runs its problems.

    ``strategy`` (and ``strategy_options``, e.g. ``{"min_unit_params": 10_000}`` for zero3)
    is the only thing to change to go distributed. ``valid_step``, ``log_step``,
    ``checkpoint_step`` count engine iterations (0: never). ``logger_type`` is one of
    ``"none"``, ``"stdout"``, ``"tensorboard"`` (needs the tensorboard package) or ``"csv"``
    (``log_dir/metrics.csv``). ``resume_from`` loads a checkpoint written by the engine.
    """

    strategy: str = "single"
    strategy_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    precision: str = "32-true"
    train_iters: int = 1000
    valid_step: int = 0
    log_step: int = 100
    logger_type: str = "none"
    log_dir: str = "out/logs"
    early_stopping: EarlyStopping | None = None
    checkpoint_step: int = 0
    checkpoint_dir: str | None = None
    checkpoint_format: str = "sharded"
    resume_from: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        from metadist.strategies.registry import available

        if canonical_strategy(self.strategy) not in available():
            raise ValueError(f"strategy {self.strategy!r} is not known; choose one of: "
                             f"{', '.join(available())}")
        if "precision" in self.strategy_options:
            raise ValueError("set precision with EngineConfig(precision=...) or per problem "
                             "with ProblemConfig(precision=...), not in strategy_options")
        object.__setattr__(self, "precision", Precision(self.precision).mode)
        object.__setattr__(self, "strategy", canonical_strategy(self.strategy))
        match self.logger_type:
            case "none" | "stdout" | "tensorboard" | "csv":
                pass
            case _:
                raise ValueError(f"logger_type {self.logger_type!r} is not known; choose one "
                                 f"of: {', '.join(LOGGERS)}")
        match self.checkpoint_format:
            case "sharded" | "full":
                pass
            case _:
                raise ValueError(f"checkpoint_format {self.checkpoint_format!r} is not known; "
                                 f"choose one of: {', '.join(CHECKPOINT_FORMATS)}")
        for name in ("train_iters", "valid_step", "log_step", "checkpoint_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig({name}={getattr(self, name)}) must be >= 0 "
                                 "(0: never)")
        if self.checkpoint_step > 0 and not self.checkpoint_dir:
            raise ValueError("checkpoint_step > 0 needs checkpoint_dir (where to save)")
