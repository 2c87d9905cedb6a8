"""Betty's setters under the drop-in (issue 47, item 5): ``Engine.set_dependency``,
``Problem.set_module``, ``set_optimizer``, ``set_scheduler`` and ``set_train_data_loader``.

Reproduction: the drop-in had none of them (AttributeError), so a Betty program that
changes its graph, a module or an optimizer in the middle of training
(tests/betty_programs/replacements.py) stopped where Betty goes on. Now each is set up under
the engine's strategy where Betty patches it: the program equals Betty 0.2.1 in one process,
and its own one process on two ranks under "distributed", "zero" and "fsdp".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import peers
from betty_programs.compare import (
    RTOL_BETTY,
    RTOL_RANKS,
    assert_states_close,
    two_rank_pool,
)


def _one_process() -> dict[str, Any]:
    peers.use()
    peers.quiet_betty()
    from betty_programs.replacements import run

    return {"betty": run("betty"), "compat": run("compat"),
            "unchanged": run("compat", train_iters=20)}


def _on_ranks(strategy: str) -> dict[str, Any]:
    peers.use()
    from betty_programs.replacements import run

    return run("compat", strategy)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    out: dict[str, Any] = peers.run_on(1, _one_process)[0]
    return out


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[peers.Reopening]:
    yield from two_rank_pool()


def test_a_program_that_changes_itself_runs_as_on_betty(one_process: dict[str, Any]) -> None:
    betty, ours = one_process["betty"], one_process["compat"]
    assert ours["counts"] == betty["counts"] == {"outer": 8, "inner1": 40, "inner2": 40}
    assert ours["graph"] == betty["graph"] == {
        "outer": ([], ["inner2"], 1, False), "inner1": ([], [], 0, True),
        "inner2": (["outer"], [], 0, True)}
    assert ours["learning_rates"] == betty["learning_rates"]
    assert betty["learning_rates"]["inner1"] == [0.02]  # the new optimizer steps
    assert_states_close(ours["final"], betty["final"], RTOL_BETTY)
    # the change matters: inner2 runs its fresh module from 0.1, the upper follows inner2
    assert float((ours["final"]["inner2.w"] - 0.1).abs().max()) > 1e-3


@pytest.mark.parametrize("strategy", ["distributed", "zero", "fsdp"])
def test_the_same_program_on_two_ranks_equals_one_process(
        one_process: dict[str, Any], two_ranks: peers.Reopening, strategy: str) -> None:
    want = one_process["compat"]
    for out in two_ranks.run(_on_ranks, strategy):
        assert out["counts"] == want["counts"] and out["graph"] == want["graph"]
        assert out["learning_rates"] == want["learning_rates"]
        assert_states_close(out["final"], want["final"], RTOL_RANKS)


def _loaders(impl: str) -> list[float]:
    """A problem's loader replaced in the middle of an epoch: the epoch finishes on the old
    one (Betty's iterator), the next ones read the new one."""
    from betty_programs.ported import api

    b = api(impl)
    seen: list[float] = []

    class Only(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            (x,) = batch
            seen.append(float(x.sum()))
            return (self.module(x) ** 2).mean()

    first = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.arange(8.0).reshape(8, 1)), batch_size=2)
    second = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        100 + torch.arange(4.0).reshape(4, 1)), batch_size=2)
    torch.manual_seed(0)
    net = torch.nn.Linear(1, 1)
    only = Only(name="only", module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                train_data_loader=first, config=b.Config())

    class Switching(b.Engine):  # type: ignore[misc,name-defined]
        def train_step(self) -> None:
            if self.global_step == 2:
                only.set_train_data_loader(second)
            super().train_step()

    Switching(config=b.EngineConfig(train_iters=8, logger_type="none"), problems=[only],
              dependencies={"u2l": {}, "l2u": {}}).run()
    return seen


def _loaders_both() -> dict[str, Any]:
    peers.use()
    peers.quiet_betty()
    return {impl: _loaders(impl) for impl in ("betty", "compat")}


def test_a_loader_replaced_mid_epoch_takes_over_at_the_next_epoch() -> None:
    out = peers.run_on(1, _loaders_both)[0]
    # batches of the first loader sum to 1, 5, 9, 13; the second's to 201, 205
    assert out["compat"] == out["betty"] == [1.0, 5.0, 9.0, 13.0, 201.0, 205.0, 201.0, 205.0]
