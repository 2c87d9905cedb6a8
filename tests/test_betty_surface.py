"""Betty's surface that its own examples use (issue 47, item 5), each against Betty 0.2.1
itself in one process.

* Validation: Betty prints ``[Validation] [Global Step N] key: value || ...`` and takes
  whatever ``validation()`` returns (numbers, tensors, lists, strings); the drop-in printed
  nothing and stopped at ``float()`` of a list ("float() argument must be ...").
* ``Problem._global_step`` (the pruning example reads it), ``Problem.clear_dependencies``,
  ``Env.accelerator``: missing (AttributeError) before.
* ``HigherIterativeProblem``: missing; Betty 0.2.1 itself fails on it under torch 2.13, so
  constructing one says what to use instead.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
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


def _surface() -> dict[str, Any]:
    peers.use()
    peers.quiet_betty()
    import importlib

    from betty_programs.overrides import run

    out: dict[str, Any] = {}
    for impl, root in (("betty", "betty"), ("compat", "metadist.compat.betty")):
        result = run(impl, override=False, train_iters=10)
        env = importlib.import_module(f"{root}.envs").Env
        out[impl] = {"global_steps": result["global_steps"],
                     "dependencies": result["dependencies"],
                     "accelerator": env.accelerator}
    return out


def test_global_step_clear_dependencies_and_accelerator_are_bettys() -> None:
    out = peers.run_on(1, _surface)[0]
    assert out["compat"] == out["betty"], out
    assert out["betty"]["global_steps"] == {"outer": 0, "inner": 10}
    assert out["betty"]["dependencies"][1] == [(0, 0, 0), (0, 0, 0)]


def test_higher_iterative_problem_says_what_to_use() -> None:
    from metadist.compat.betty.configs import Config
    from metadist.compat.betty.problems import HigherIterativeProblem

    class Inner(HigherIterativeProblem):  # as Betty's users write it
        def training_step(self, batch: Any) -> torch.Tensor:
            return torch.zeros(())

    with pytest.raises(NotImplementedError) as info:
        Inner(name="inner", config=Config())
    message = str(info.value)
    assert "torch 2.13" in message and "ProblemConfig(method='unrolled')" in message, message


def _inner_module_output(strategy: str) -> list[float]:
    """What validation computes through Betty's distributed idiom, ``problem.module.module``
    (``problem.module`` under Betty's "default")."""
    peers.use()
    from betty_programs.overrides import run

    x = torch.linspace(-1, 1, 40, dtype=torch.float64).view(2, 20)

    def validation(engine: Any) -> dict[str, Any]:
        module = engine.inner.module
        inner = module if strategy == "default" else module.module
        return {"out": [float(v) for v in inner(x)[0]]}

    seen: list[float] = []
    run("compat", strategy, override=False, train_iters=10, valid_step=10,
        validation=lambda engine: (result := validation(engine), seen.extend(result["out"]))[0])
    return seen


@pytest.mark.parametrize("strategy", ["distributed", "zero", "fsdp"])
def test_bettys_module_module_idiom_in_validation(strategy: str) -> None:
    """Before: ``AttributeError: 'ChildNet' object has no attribute 'module'`` (validation's
    problem.module is a plain copy)."""
    want = peers.run_on(1, _inner_module_output, ("default",))[0]
    got = peers.run_on(2, _inner_module_output, (strategy,))[0]  # rank 0 validates
    assert len(want) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=1e-12)
