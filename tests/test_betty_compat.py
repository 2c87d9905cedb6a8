"""metadist.compat.betty: Betty programs run with only their imports changed, with Betty's
names, defaults and semantics, and N ranks compute what one process computes."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import peers
from betty_programs.reweight import run
from metadist.compat.betty.configs import Config, EngineConfig
from metadist.meta import EngineConfig as NativeEngineConfig
from metadist.meta import ProblemConfig
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

PROGRAM = Path(__file__).parent / "betty_programs" / "reweight.py"

# Betty 0.2.1's defaults (betty/configs/*.py), field for field.
BETTY_CONFIG = dict(type="darts", unroll_steps=1, first_order=True, retain_graph=False,
                    allow_unused=True, gradient_accumulation=1, gradient_clipping=0.0,
                    precision="fp32", initial_dynamic_scale=4096.0, scale_factor=2.0,
                    warmup_steps=0, log_step=-1, log_local_step=False, darts_alpha=0.01,
                    darts_multitask=False, sama_adam_alpha=1.0, sama_multitask=False,
                    neumann_iterations=1, neumann_alpha=1.0, cg_iterations=1, cg_alpha=1.0)
BETTY_ENGINE = dict(train_iters=50000, valid_step=500, logger_type="none", roll_back=False,
                    backend="nccl", strategy="default", early_stopping=False,
                    early_stopping_mode="min", early_stopping_tolerance=5,
                    early_stopping_metric="loss")


def _params(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in result.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return run_on_ranks(run, 1, args=(None, "default", "darts", 3, 10))[0]


def test_defaults_are_bettys() -> None:
    assert dataclasses.asdict(Config()) == BETTY_CONFIG
    # Betty's fields, and metadist's strategy options (empty: nothing changes)
    assert dataclasses.asdict(EngineConfig()) == {**BETTY_ENGINE, "strategy_options": {}}


@pytest.mark.parametrize(("strategy", "world"), [("distributed", 2), ("zero", 2), ("fsdp", 3)])
def test_three_level_program_equals_one_process(one_process: dict[str, Any], strategy: str,
                                                world: int) -> None:
    results = run_on_ranks(run, world, args=(None, strategy, "darts", 3, 10))
    for result in results:  # every rank holds the one-process model
        assert_tensors_close(_params(result), _params(one_process))
        assert result["calls"] == one_process["calls"]
    # the callbacks ran where Betty runs them: a window of 2 steps, then the upper's grad
    assert one_process["calls"][:4] == [("start", 0), ("param", 1), ("param", 2), ("grad", 1)]


def test_betty_program_under_metadist_run(tmp_path: Path, one_process: dict[str, Any]) -> None:
    out = tmp_path / "params.pt"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    proc = subprocess.run([sys.executable, "-m", "metadist", "run", "--nproc", "2",
                           str(PROGRAM), str(out), "distributed", "darts", "3"],
                          check=False, capture_output=True, text=True, timeout=300, env=env,
                          cwd=PROGRAM.parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(out)
    ours = _params(result)
    # the CLI run takes the program's default 12 iterations
    reference = run_on_ranks(run, 1, args=(None, "default", "darts", 3, 12))[0]
    assert_tensors_close(ours, _params(reference))


def _bettys_numbers() -> dict[str, Any]:
    """Betty 0.2.1 itself (from .peers/) on the Meta-Weight-Net cases and the iMAML program."""
    peers.use()
    peers.quiet_betty()
    from betty_programs.imaml import run as imaml
    from betty_programs.mwn import CASES
    from betty_programs.mwn import run as mwn

    return {"mwn": {case: mwn("betty", case) for case in CASES}, "imaml": imaml("betty")}


@pytest.fixture(scope="module")
def betty() -> dict[str, Any]:
    """Betty's numbers, computed once per module in a process of its own."""
    out: dict[str, Any] = peers.run_on(1, _bettys_numbers)[0]
    return out


def _all_cases() -> dict[str, dict[str, Any]]:
    from betty_programs.mwn import CASES
    from betty_programs.mwn import run as mwn

    return {case: mwn("compat", case) for case in CASES}


def test_same_numbers_as_betty_itself(betty: dict[str, Any]) -> None:
    """Every case of the Meta-Weight-Net program (darts, neumann, Betty's cg with
    cg_alpha=0.1, sama with an Adam lower level, warmup_steps, roll_back, gradient
    accumulation with the scheduler stepping per micro-step, custom_optimizer_step, epoch
    callbacks) against Betty 0.2.1 run beside it on the same machine: the same callback
    trace, counts, learning rate, and parameters to float64 rounding (the same operations in
    another order: 1e-10 is far above what 10 iterations amplify that to)."""
    reference = betty["mwn"]
    ours = run_on_ranks(_all_cases, 1)[0]
    assert ours.keys() == reference.keys()
    for case, want in reference.items():
        got = ours[case]
        assert got["calls"] == want["calls"], case
        assert got["counts"] == want["counts"] and got["lr"] == want["lr"], case
        for name in _params(want):
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12,
                                       msg=lambda m, c=case, n=name: f"{c} {n}: {m}")


def _mwn_on(strategy: str, case: str) -> dict[str, Any]:
    from betty_programs.mwn import run as mwn

    return mwn("compat", case, strategy)


@pytest.mark.parametrize(("strategy", "case"), [("zero", "sama_adam"), ("fsdp", "cg"),
                                                 ("distributed", "roll_back")])
def test_betty_cases_equal_betty_at_two_ranks(betty: dict[str, Any], strategy: str,
                                              case: str) -> None:
    want = betty["mwn"][case]
    for got in run_on_ranks(_mwn_on, 2, args=(strategy, case)):
        assert got["calls"] == want["calls"]
        assert_tensors_close(_params(got), _params(want), where=f"{strategy} {case}")


def test_strategy_and_precision_names_everywhere() -> None:
    for betty, ours in [("default", "single"), ("distributed", "ddp"), ("zero", "zero1"),
                        ("fsdp", "zero3")]:
        assert NativeEngineConfig(strategy=betty).strategy == ours
    assert NativeEngineConfig(precision="bf16").precision == "bf16-mixed"
    assert ProblemConfig(precision="fp16").precision == "16-mixed"
    assert ProblemConfig(precision="fp32").precision == "32-true"
    with pytest.raises(ValueError, match="choose one of"):
        EngineConfig(strategy="accelerate")


def test_what_cannot_mean_the_same_is_refused() -> None:
    with pytest.raises(ValueError, match="darts_multitask"):
        Config(darts_multitask=True)
    with pytest.raises(ValueError, match="choose one of"):
        Config(type="maml")
    if importlib.util.find_spec("wandb") is None:
        from metadist.compat.betty.logging import logger

        with pytest.raises(ImportError, match="pip install wandb"):
            logger("wandb")


def _first_order_off() -> tuple[dict[str, Any], dict[str, Any]]:
    import betty_programs.reweight as program

    torch.manual_seed(2)
    before = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid()).double()
    original = program.Config

    def patched(**kw: Any) -> Config:
        if kw.get("log_step") == 0:  # the reweight problem's config
            kw["first_order"] = False
        return original(**kw)

    program.Config = patched  # type: ignore[assignment,misc]
    try:
        after = program.run(None, "default", "darts", 2, 6)
    finally:
        program.Config = original  # type: ignore[misc]
    return {f"reweight.{k}": v for k, v in before.state_dict().items()}, after


def test_first_order_false_on_the_upper_turns_the_response_off() -> None:
    """Betty's first_order sits on the upper problem: False drops the hypergradient through
    its lower problems (its loss reaches its parameters only through them here, so Adam sees
    zero gradients and leaves them where they started)."""
    before, after = run_on_ranks(_first_order_off, 1)[0]
    assert_tensors_close({k: after[k] for k in before}, before)


def _attributes() -> dict[str, Any]:
    from metadist.compat.betty.engine import Engine
    from metadist.compat.betty.problems import ImplicitProblem

    class Low(ImplicitProblem):
        def training_step(self, batch: Any) -> torch.Tensor:
            return (self.module(batch[0]) * self.up(torch.ones(1, 1))).pow(2).mean()

    class Up(ImplicitProblem):
        def training_step(self, batch: Any) -> torch.Tensor:
            return self.low(batch[0]).pow(2).mean()

    module = nn.Linear(2, 1)
    module.tag = "mine"  # type: ignore[assignment]
    data = [(torch.ones(4, 2),)] * 4
    low = Low("low", Config(), module, torch.optim.SGD(module.parameters(), lr=0.1), None, data)
    up_module = nn.Linear(1, 1)
    up = Up("up", Config(), up_module, torch.optim.SGD(up_module.parameters(), lr=0.1), None,
           data)
    Engine([up, low], EngineConfig(train_iters=3, valid_step=0),
           {"u2l": {up: [low]}, "l2u": {low: [up]}}).run()
    return {"leaf": (low.leaf, up.leaf), "parents": [p.name for p in low.parents],
            "children": [p.name for p in up.children],
            "paths": [[p.name for p in path] for path in up.paths], "count": low.count,
            "tag": low.module.tag, "device": str(low.device),
            "params": len(low.parameters()), "trainable": len(low.trainable_parameters())}


def test_problem_attributes_are_bettys() -> None:
    got = run_on_ranks(_attributes, 1)[0]
    assert got == {"leaf": (True, False), "parents": ["up"], "children": ["low"],
                   "paths": [["up", "low", "up"]], "count": 3, "tag": "mine",
                   "device": "cpu", "params": 2, "trainable": 2}


def _native_first_order_on_the_lower() -> str:
    import torch.nn.functional as F

    from metadist.meta import Engine, EngineConfig, Problem

    class Inner(Problem):
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            losses = F.cross_entropy(self(x), y, reduction="none")
            return (self.outer(losses.detach().unsqueeze(1)).squeeze(1) * losses).mean()

    class Outer(Problem):
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.inner(x), y)

    clf, wnet = nn.Linear(4, 3), nn.Sequential(nn.Linear(1, 1), nn.Sigmoid())
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))] * 3
    inner = Inner("inner", clf, torch.optim.SGD(clf.parameters(), lr=0.1),
                  train_data_loader=data, config=ProblemConfig(first_order=True))
    outer = Outer("outer", wnet, torch.optim.SGD(wnet.parameters(), lr=0.1),
                  train_data_loader=data)
    engine = Engine([inner, outer], EngineConfig(train_iters=2),
                    {"u2l": {outer: [inner]}, "l2u": {inner: [outer]}})
    with pytest.raises(ValueError) as err:
        engine.run()
    return str(err.value)


def test_bettys_first_order_carried_to_the_native_lower_level_is_explained() -> None:
    """Betty's default first_order=True, carried onto metadist's lower problem, drops the
    response (metadist's meaning): the upper would silently never learn. It raised a raw
    autograd error before; now it says which setting and why."""
    message = run_on_ranks(_native_first_order_on_the_lower, 1)[0]
    assert "first_order=True) on ['inner']" in message and "Betty" in message


def _zero3_parameter_attribute() -> list[float]:
    import metadist

    model = nn.Sequential(nn.Linear(2, 2))
    model.scale = nn.Parameter(torch.ones(2))  # type: ignore[assignment]
    wrapped = metadist.strategy("zero3", min_unit_params=1).setup_module(model)
    wrapped.scale.data.zero_()  # Betty programs do this in on_inner_loop_start
    return wrapped.full_parameters()["scale"].tolist()


def test_zero3_parameter_written_through_the_wrapper_changes_it() -> None:
    """Between forwards a zero3 parameter is this rank's slice of it: an in-place write
    through ``self.module.<param>`` changes every rank's slice, as one process's would
    (before: it raised, naming full_parameters and load_state_dict)."""
    assert run_on_ranks(_zero3_parameter_attribute, 2) == [[0.0, 0.0]] * 2


def _imaml(strategy: str) -> dict[str, Any]:
    from betty_programs.imaml import run as imaml

    return imaml("compat", strategy)


@pytest.mark.parametrize(("strategy", "world"), [("default", 1), ("distributed", 2),
                                                 ("fsdp", 2)])
def test_imaml_program_equals_betty(betty: dict[str, Any], strategy: str, world: int) -> None:
    """Betty's implicit-MAML layout (Env sampling tasks from a custom train_step calling
    leaf.step, get_batch from the Env, a proximal term on self.parameters() and
    self.outer.parameters(), load_state_dict at each inner loop's start, accumulation over
    tasks, Betty's cg) against Betty 0.2.1's own numbers, in one process and on 2 ranks."""
    want = betty["imaml"]
    for got in run_on_ranks(_imaml, world, args=(strategy,)):
        assert got["counts"] == want["counts"]
        if world == 1:
            for name in _params(want):
                torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
        else:
            assert_tensors_close(_params(got), _params(want), where=strategy)


def _early_stopping() -> tuple[int, int]:
    from metadist.compat.betty.engine import Engine
    from metadist.compat.betty.problems import ImplicitProblem

    class P(ImplicitProblem):
        def training_step(self, batch: Any) -> torch.Tensor:
            return self.module(batch[0]).pow(2).mean()

    class Stopping(Engine):
        scores = [5.0, 4.0, 4.5, 4.2, 4.1, 3.0]

        def validation(self) -> dict[str, float]:
            return {"loss": self.scores.pop(0)}

    module = nn.Linear(2, 1)
    p = P("p", Config(), module, torch.optim.SGD(module.parameters(), lr=0.1), None,
          [(torch.ones(4, 2),)] * 4)
    engine = Stopping([p], EngineConfig(train_iters=100, valid_step=2, early_stopping=True,
                                        strategy="distributed",
                                        early_stopping_tolerance=3), {"u2l": {}, "l2u": {}})
    engine.run()
    return engine.global_step, p.count


def test_early_stopping_fields_stop_every_rank_at_the_same_iteration() -> None:
    """Betty's early_stopping/_mode/_tolerance/_metric: the best 4.0 at the 2nd validation,
    then 3 without improvement -> stop after the 5th validation (iteration 10). Betty 0.2.1
    raises AttributeError there (its EarlyStopping reads self.patience, never set)."""
    assert run_on_ranks(_early_stopping, 2) == [(10, 10), (10, 10)]


def _batchnorm_warnings(options: dict[str, Any]) -> list[str]:
    """A Betty program with BatchNorm on 2 ranks: what it warns (rank 0 says it once)."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    import metadist.compat.betty.engine as compat_engine
    from metadist.compat.betty.engine import Engine
    from metadist.compat.betty.problems import ImplicitProblem

    compat_engine._warned_batchnorm = False  # a pooled rank may have said it for another test

    class Net(ImplicitProblem):
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return ((self(x) - y) ** 2).mean()

    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # said once per process, however many engines
            torch.manual_seed(0)  # a module of its own: one module is set up once
            module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
            problem = Net("net", Config(), module, torch.optim.SGD(module.parameters(), lr=0.1),
                          train_data_loader=data)
            Engine([problem], EngineConfig(train_iters=1, strategy="distributed",
                                           strategy_options=options)).run()
    return [str(w.message) for w in caught if "BatchNorm" in str(w.message)]


def test_batchnorm_on_several_ranks_warns_once_naming_the_option() -> None:
    unsynced = run_on_ranks(_batchnorm_warnings, 2, args=({},))
    assert len(unsynced[0]) == 1 and unsynced[1] == []  # rank 0 says it, once
    assert "strategy_options={'sync_batchnorm': True}" in unsynced[0][0]
    assert run_on_ranks(_batchnorm_warnings, 2, args=({"sync_batchnorm": True},)) == [[], []]


def _indexed(impl: str, strategy: str = "default") -> dict[str, Any]:
    if impl == "betty":
        peers.use()
        peers.quiet_betty()
    from betty_programs.indexed import run as indexed

    return indexed(impl, strategy)


def test_a_problem_reaches_its_module_as_a_container_as_on_betty() -> None:
    """``self.module[0]``, ``len(self.module)`` and iteration over a problem's module, as
    Betty's "default" strategy allows (before: TypeError, the set-up model was not
    subscriptable), give Betty's numbers (float64, the same operations: 1e-10), and the same
    on 2 ranks under "distributed" and "fsdp"."""
    want = peers.run_on(1, _indexed, ("betty",))[0]
    got = run_on_ranks(_indexed, 1, args=("compat",))[0]
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)
    for strategy in ("distributed", "fsdp"):
        for rank, result in enumerate(run_on_ranks(_indexed, 2, args=("compat", strategy))):
            assert_tensors_close(result, want, f"{strategy} rank={rank}")
