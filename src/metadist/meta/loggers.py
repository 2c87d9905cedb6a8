"""Where the engine writes training and validation metrics (rank 0 only: the other ranks
get a logger that drops everything, so no logger ever issues a collective)."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from metadist.meta.config import LOGGERS


class MetricLogger(Protocol):
    def log(self, stats: dict[str, float], tag: str, step: int) -> None: ...

    def close(self) -> None: ...


class NoLogger:
    """Drops everything (``logger_type="none"`` and every rank but 0)."""

    def log(self, stats: dict[str, float], tag: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class StdoutLogger:
    """One line per call: ``[iteration 100] train: inner/loss=0.1234 outer/loss=0.5``."""

    def log(self, stats: dict[str, float], tag: str, step: int) -> None:
        values = " ".join(f"{k}={v:.6g}" for k, v in stats.items())
        sys.stdout.write(f"[iteration {step}] {tag}: {values}\n")
        sys.stdout.flush()

    def close(self) -> None:
        pass


class CsvLogger:
    """``log_dir/metrics.csv`` in long form (step, tag, metric, value), so metrics may differ
    from one call to the next."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = Path(log_dir) / "metrics.csv"
        with open(self.path, "w", newline="") as f:
            csv.writer(f).writerow(["step", "tag", "metric", "value"])

    def log(self, stats: dict[str, float], tag: str, step: int) -> None:
        # Opened per call: complete rows are on disk even if the run dies, nothing to close.
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows([step, tag, k, repr(float(v))] for k, v in stats.items())

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars ``tag/metric`` in a TensorBoard event file under ``log_dir``."""

    def __init__(self, log_dir: str) -> None:
        self._writer: Any = tensorboard_writer_class()(log_dir=log_dir)

    def log(self, stats: dict[str, float], tag: str, step: int) -> None:
        for key, value in stats.items():
            self._writer.add_scalar(f"{tag}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def tensorboard_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or an error saying how to get it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError("logger_type='tensorboard' needs the tensorboard package, which is "
                          "not importable here: pip install tensorboard, or choose one of: "
                          f"{', '.join(x for x in LOGGERS if x != 'tensorboard')}") from err
    return SummaryWriter


def make_logger(logger_type: str, log_dir: str, rank: int) -> MetricLogger:
    """The logger for ``logger_type`` on rank 0, :class:`NoLogger` elsewhere. The
    tensorboard import is checked on every rank, so a missing package fails them all."""
    match logger_type:
        case "none":
            return NoLogger()
        case "stdout":
            return StdoutLogger() if rank == 0 else NoLogger()
        case "csv":
            return CsvLogger(log_dir) if rank == 0 else NoLogger()
        case "tensorboard":
            tensorboard_writer_class()
            return TensorBoardLogger(log_dir) if rank == 0 else NoLogger()
    raise ValueError(f"logger_type {logger_type!r} is not known; choose one of: "
                     f"{', '.join(LOGGERS)}")
