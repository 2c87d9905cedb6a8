"""Betty's overridable steps under the drop-in (tests/betty_programs/overrides.py).

Reproduction (issue 47, item 1): a subclass overriding ``Problem.optimizer_step`` (or
``one_step_descent``) was silently ignored: the drop-in never called them, so the program
computed what it computes without the override while Betty applied it. Now the engine steps
every problem through ``one_step_descent`` and ``optimizer_step``, so an override runs where
Betty runs it, under every strategy; overrides the drop-in has no step for (``backward``,
``step_normal``, ``step_after_roll_back``) stop when the engine is built, naming the method.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import peers
from betty_programs.compare import (
    ATOL,
    RTOL_BETTY,
    RTOL_RANKS,
    assert_states_close,
    two_rank_pool,
)


def _one_process() -> dict[str, Any]:
    peers.use()
    peers.quiet_betty()
    from betty_programs.overrides import run

    return {"betty": run("betty"), "compat": run("compat"),
            "compat_plain": run("compat", override=False)}


def _on_ranks(strategy: str) -> dict[str, Any]:
    peers.use()
    from betty_programs.overrides import run

    return run("compat", strategy)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    out: dict[str, Any] = peers.run_on(1, _one_process)[0]
    return out


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[peers.Reopening]:
    yield from two_rank_pool()


def test_overridden_steps_run_as_on_betty(one_process: dict[str, Any]) -> None:
    betty, ours, plain = one_process["betty"], one_process["compat"], one_process["compat_plain"]
    assert ours["counts"] == betty["counts"] == {"outer": 8, "inner": 40}
    assert len(ours["descents"]) == len(betty["descents"]) == 8
    torch.testing.assert_close(torch.tensor(ours["descents"]), torch.tensor(betty["descents"]),
                               rtol=RTOL_BETTY, atol=ATOL)
    assert_states_close(ours["final"], betty["final"], RTOL_BETTY)
    # the override matters: without it the child ends elsewhere
    moved = (plain["final"]["inner.w"] - ours["final"]["inner.w"]).abs().max()
    assert moved > 1e-3, float(moved)


@pytest.mark.parametrize("strategy", ["distributed", "zero", "fsdp"])
def test_overridden_steps_on_two_ranks_equal_one_process(
        one_process: dict[str, Any], two_ranks: peers.Reopening, strategy: str) -> None:
    for out in two_ranks.run(_on_ranks, strategy):
        assert out["counts"] == one_process["compat"]["counts"]
        assert_states_close(out["final"], one_process["compat"]["final"], RTOL_RANKS)


def _refused(method: str) -> str:
    from betty_programs.logreg_hpo import ChildNet
    from metadist.compat.betty.configs import Config, EngineConfig
    from metadist.compat.betty.engine import Engine
    from metadist.compat.betty.problems import ImplicitProblem

    class Lower(ImplicitProblem):
        def training_step(self, batch: Any) -> torch.Tensor:
            return self.module(batch[0])[0].sum()

    def override(self: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("never called")

    custom = type("Custom", (Lower,), {method: override})
    module = ChildNet()
    problem = custom(name="lower", config=Config(), module=module,
                     optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                     train_data_loader=[(torch.randn(4, 20, dtype=torch.float64),)])
    try:
        Engine(config=EngineConfig(train_iters=1, logger_type="none"), problems=[problem])
    except NotImplementedError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("method", ["backward", "step_normal", "step_after_roll_back"])
def test_overrides_without_a_counterpart_are_named(method: str) -> None:
    message = peers.run_on(1, _refused, (method,))[0]
    assert f"Custom.{method} overrides Betty's Problem.{method}" in message, message
    assert "optimizer_step or one_step_descent" in message, message
