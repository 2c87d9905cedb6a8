"""Betty's surface that its own examples use (issue 47, item 5), each against Betty 0.2.1
itself in one process.

* Validation: Betty prints ``[Validation] [Global Step N] key: value || ...`` and takes
  whatever ``validation()`` returns (numbers, tensors, lists, strings); the drop-in printed
  nothing and stopped at ``float()`` of a list ("float() argument must be ...").
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import peers


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("[Validation]"):
            self.lines.append(record.getMessage())


def _validated(impl: str) -> list[str]:
    from betty_programs.overrides import run

    lines = _Lines()
    log = logging.getLogger("betty")  # Betty's logger and the drop-in's, by name
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        run(impl, override=False, train_iters=10, valid_step=5,
            validation=lambda engine: {"loss": torch.tensor(0.25), "per_class": [
                torch.tensor(0.5), 0.75], "note": "fine", "step": engine.global_step})
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    return lines.lines


def _both() -> dict[str, Any]:
    peers.use()
    peers.quiet_betty()
    return {impl: _validated(impl) for impl in ("betty", "compat")}


def test_validation_line_and_results_are_bettys() -> None:
    out = peers.run_on(1, _both)[0]
    want = [f"[Validation] [Global Step {n}] loss: 0.25 || per_class_0: 0.5 || "
            f"per_class_1: 0.75 || note: fine || step: {n}" for n in (5, 10)]
    assert out["betty"] == want, out["betty"]
    assert out["compat"] == want, out["compat"]
