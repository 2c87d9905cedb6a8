"""Betty's ``betty.logging``: ``logger(logger_type)`` returns an object with ``log(stats,
tag, step)`` and the ``debug/info/warning/error`` messages of the global "betty" logger."""

from __future__ import annotations

import logging as _logging
import sys
from typing import Any

from metadist.meta.loggers import TensorBoardLogger, tensorboard_writer_class

_logger: _logging.Logger | None = None


def get_logger() -> _logging.Logger:
    """The global message logger (INFO to stdout, Betty's format)."""
    global _logger
    if _logger is None:
        _logger = _logging.getLogger("betty")
        _logger.propagate = False
        _logger.setLevel(_logging.INFO)
        handler = _logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(_logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s",
                                                "%Y-%m-%d %H:%M:%S"))
        _logger.addHandler(handler)
    return _logger


class LoggerBase:
    """Metrics go nowhere; messages go to :func:`get_logger`."""

    def log(self, stats: dict[str, Any], tag: str | None = None, step: int | None = None
            ) -> None:
        return None

    def close(self) -> None:
        return None

    @staticmethod
    def debug(msg: str, *args: Any, **kwargs: Any) -> None:
        get_logger().debug(msg, *args, **kwargs)

    @staticmethod
    def info(msg: str, *args: Any, **kwargs: Any) -> None:
        get_logger().info(msg, *args, **kwargs)

    @staticmethod
    def warning(msg: str, *args: Any, **kwargs: Any) -> None:
        get_logger().warning(msg, *args, **kwargs)

    @staticmethod
    def error(msg: str, *args: Any, **kwargs: Any) -> None:
        get_logger().error(msg, *args, **kwargs)


def _scalars(stats: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in stats.items():
        values = value if isinstance(value, list | tuple) else [value]
        for i, v in enumerate(values):
            out[key if len(values) == 1 else f"{key}_{i}"] = float(v)
    return out


class TensorBoardLoggerBase(LoggerBase):
    """Metrics to tensorboard (``log_dir``: metadist's default, ``out/logs``)."""

    def __init__(self, log_dir: str = "out/logs") -> None:
        self._writer = TensorBoardLogger(log_dir)

    def log(self, stats: dict[str, Any], tag: str | None = None, step: int | None = None
            ) -> None:
        self._writer.log(_scalars(stats), tag or "", step or 0)


class WandBLogger(LoggerBase):
    """Metrics to Weights & Biases (``wandb.init()`` on first use, as Betty does)."""

    def __init__(self) -> None:
        import wandb

        self._wandb = wandb
        if wandb.run is None:
            wandb.init()

    def log(self, stats: dict[str, Any], tag: str | None = None, step: int | None = None
            ) -> None:
        prefix = f"{tag}/" if tag else ""
        self._wandb.log({prefix + k: v for k, v in _scalars(stats).items()}, step=step)


def logger(logger_type: str = "none") -> LoggerBase:
    """A metrics logger by Betty's name: "none", "tensorboard" or "wandb". A missing package
    raises before training (Betty falls back to "none" with a warning, losing the metrics)."""
    match logger_type:
        case "none":
            return LoggerBase()
        case "tensorboard":
            try:
                tensorboard_writer_class()
            except ImportError:  # Betty's choices, not metadist's native loggers
                raise ImportError("logger_type='tensorboard' needs the tensorboard package, "
                                  "which is not importable here: pip install tensorboard (or "
                                  "choose logger_type='wandb' or 'none')") from None
            return TensorBoardLoggerBase()
        case "wandb":
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ImportError("logger_type='wandb' needs the wandb package: pip install "
                                  "wandb (or choose logger_type='tensorboard' or 'none')") from None
            return WandBLogger()
    raise ValueError(f"logger_type {logger_type!r} is not known; choose one of: none, "
                     "tensorboard, wandb")
