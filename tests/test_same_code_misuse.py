"""torch-DDP habits under every strategy: an optimizer built after setup, a backward on a model
that never went through setup, and meta-layer reads right after a zero1/zero2 step. Each either
keeps the ranks identical (and equal to the documented form) or raises before any wrong value.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.meta import Engine, EngineConfig, Problem, ProblemConfig
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

STEPS = 12
SHARDED = {"min_unit_params": 1}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A different batch on every rank (the ranks drift apart unless gradients are synced)."""
    g = torch.Generator().manual_seed(100 * step + metadist.world().rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _options(strategy: str) -> dict[str, Any]:
    return SHARDED if strategy in ("zero3", "fsdp", "hsdp") else {}


def _train(strategy: str, how: str, precision: str = "32-true") -> Any:
    """``documented``: the optimizer passes through setup; ``after_setup``: built on the set-up
    model's parameters; ``replaced``: setup's optimizer swapped for a new one."""
    s = metadist.strategy(strategy, precision=precision, **_options(strategy))
    net = _net()
    if how == "documented":
        model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    elif how == "after_setup":
        model = s.setup_module(net)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        model, _ = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            s.backward(((model(x) - y) ** 2).mean())
            opt.step()
    except RuntimeError as e:
        return str(e)
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


# ddp syncs every backward whichever optimizer steps; zero3/hsdp's optimizer steps the shards
# and every gather reads their current version. zero1/zero2 must step through their own hooks.
WORKS = ("single", "ddp", "zero3", "fsdp", "hsdp")
REFUSES = ("zero1", "zero2")
STRATEGIES = (*WORKS, *REFUSES)
# The cells of docs/meta-learning.md's table: single on its one rank, the others at 2 and 3.
CELLS = [("single", 1)] + [(s, n) for s in STRATEGIES[1:] for n in (2, 3)]


@pytest.mark.parametrize("how", ["after_setup", "replaced"])
@pytest.mark.parametrize(("strategy", "n"), CELLS)
def test_an_optimizer_the_strategy_never_saw_is_exact_or_refused(strategy: str, n: int,
                                                                 how: str) -> None:
    want = run_on_ranks(_train, n, args=(strategy, "documented"))
    got = run_on_ranks(_train, n, args=(strategy, how))
    if strategy in REFUSES:
        for message in got:
            assert isinstance(message, str), "a zero1/zero2 step on a foreign optimizer ran"
            assert re.search(rf"steps \d+ parameter\(s\) of a model set up by strategy "
                             rf"'{strategy}', but was never passed to it", message)
            assert "strategy.setup_optimizer(model, optimizer)" in message
        return
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not isinstance(g, str), g
        assert_tensors_close(g, w, f"{strategy} {how} rank {rank}")
        assert_tensors_close(g, got[0], f"{strategy} {how}: rank {rank} differs from rank 0")


def test_the_refused_optimizer_is_accepted_once_set_up() -> None:
    """What the error says to write works: setup_optimizer on an optimizer built later."""
    for result in run_on_ranks(_adopted, 2):
        assert result == "equal", result


def _adopted() -> str:
    results = []
    for how in ("documented", "adopted"):
        s = metadist.strategy("zero2")
        net = _net()
        model = s.setup_module(net)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if how == "adopted":
            opt = s.setup_optimizer(model, opt)
        else:
            model, opt = metadist.strategy("zero2").setup(
                (net := _net()), torch.optim.Adam(net.parameters(), lr=1e-2))
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            s.backward(((model(x) - y) ** 2).mean())
            opt.step()
        results.append(torch.cat([p.detach().flatten()
                                  for p in model.full_parameters().values()]))
    return "equal" if torch.equal(results[0], results[1]) else f"{results}"


def test_16_mixed_refuses_an_optimizer_that_would_step_scaled_gradients() -> None:
    for message in run_on_ranks(_train, 2, args=("ddp", "after_setup", "16-mixed")):
        assert isinstance(message, str) and "16-mixed" in message and "unscales" in message


def _backward_without_setup(strategy: str, where: str) -> str:
    s = metadist.strategy(strategy, **_options(strategy))
    net = _net()
    x, y = _batch(0)
    if where == "extra_parameter":
        try:
            model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        except ValueError as e:  # 'single' on 2+ ranks: refused before any parameter exists
            return f"setup: {e}"
        temperature = nn.Parameter(torch.ones(()))  # belongs to no set-up module
        loss = ((model(x) / temperature - y) ** 2).mean()
    else:
        loss = ((net(x) - y) ** 2).mean()
    with pytest.raises(RuntimeError) as info:
        s.backward(loss)
    return str(info.value)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_on_a_model_that_never_went_through_setup_raises(strategy: str, n: int) -> None:
    for message in run_on_ranks(_backward_without_setup, n, args=(strategy, "no_setup")):
        name = "zero3" if strategy == "fsdp" else strategy  # fsdp is zero3's other name
        assert f"strategy {name!r}: this loss reaches no parameter of a module set up by a " \
               "strategy" in message
        assert "strategy.setup(net, optimizer)" in message
    for message in run_on_ranks(_backward_without_setup, n, args=(strategy, "extra_parameter")):
        if strategy == "single":
            assert message.startswith("setup: strategy 'single' runs one process"), message
            continue
        assert "1 nn.Parameter(s) that belong to no module set up by a strategy" in message


# ----- the meta layer reads parameters only after zero1/zero2's refresh has landed -----------
class _Regression(Problem):
    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((self(x) - y) ** 2).mean()


def _trainable_after_step(strategy: str) -> list[bool]:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g))
    net = _net()
    problem = _Regression("lower", net, torch.optim.SGD(net.parameters(), lr=0.1),
                          train_data_loader=DataLoader(data, batch_size=6),
                          config=ProblemConfig())
    # the opt-in overlapped refresh (the default refreshes inside step())
    Engine([problem], config=EngineConfig(train_iters=1, strategy=strategy,
                                          strategy_options={"overlap_param_gather": True}))
    in_flight = []
    for step in range(3):
        x, y = _batch(step)
        problem.optimizer.zero_grad()
        problem.strategy.backward(((problem.wrapped(x) - y) ** 2).mean())
        problem.optimizer.step()  # launches the asynchronous refresh of every rank's copy
        problem.trainable()
        gather = problem.wrapped.gather
        in_flight.append(any(h is not None for h in gather._piece_handles))
    return in_flight


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_problem_trainable_waits_for_the_parameter_refresh(strategy: str) -> None:
    for in_flight in run_on_ranks(_trainable_after_step, 2, args=(strategy,)):
        assert in_flight == [False] * 3


def _forward_on_swapped_shards() -> str:
    s = metadist.strategy("zero3", **SHARDED)
    net = _net()
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, _ = _batch(0)
    fast = {n: p.detach() * 1.0 for n, p in model.named_parameters()}  # this rank's slices
    with pytest.raises(RuntimeError) as info:
        torch.func.functional_call(model, fast, (x,))
    return str(info.value)


def test_functional_call_on_the_shards_raises_instead_of_ignoring_them() -> None:
    for message in run_on_ranks(_forward_on_swapped_shards, 2):
        assert "replaced by other tensors (of other shapes than the parameters" in message
        assert "made by torch.func.functional_call" in message
        assert "model.functional_forward(fast, x)" in message


def _deepcopy_of_a_sharded_model() -> str:
    import copy

    s = metadist.strategy("zero3", **SHARDED)
    net = _net()
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError) as info:
        copy.deepcopy(model)
    return str(info.value)


def test_a_deep_copy_of_a_sharded_model_says_what_to_use() -> None:
    """Before: "cannot pickle 'AccumulateGrad' object" from deep inside the shards."""
    for message in run_on_ranks(_deepcopy_of_a_sharded_model, 2):
        assert "copy.deepcopy of a zero3/fsdp/hsdp model" in message
        assert "module_clone(model, by='deepcopy')" in message
