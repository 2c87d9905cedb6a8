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
    assert dataclasses.asdict(EngineConfig()) == BETTY_ENGINE


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
    with pytest.raises(ValueError, match=r"cg_alpha=1\.0"):
        Config(type="cg", cg_iterations=3, cg_alpha=0.5)
    assert Config(type="cg", cg_iterations=1, cg_alpha=0.5).cg_alpha == 0.5  # same result
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
