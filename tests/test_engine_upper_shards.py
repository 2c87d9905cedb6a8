"""An upper problem's parameters as shard pieces: the engine's hypergradient of a teacher
whose whole model is a hyperparameter of its student's loss (reached through the teacher's
forward, unit by unit) equals one process under zero3 at 2, 3 and 4 ranks and hsdp 2 x 2,
for the built-in methods (bilevel.py's ``_hparams(pieces=True)``;
test_engine_memory.py measures what it saves).

Float64. Each rank takes its slice of both levels' global batches; one process the whole.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from metadist.meta import Engine, EngineConfig, Problem, ProblemConfig
from metadist.strategies.fast_weights import FastWeights
from metadist.testing import run_on_ranks

WIDTH, BATCH, ITERS = 7, 12, 6  # 7 wide: uneven shards at 2, 3 and 4 ranks; 12 over 1-4
SHARDED = {"min_unit_params": 30}  # a unit per Linear of the teacher, padded flats
# float64 rounding, in another order on each side, amplified by darts' central difference:
# measured at most 1.2e-14 (darts, 3 ranks), 1.1e-16 for the others; atol 1e-12 leaves 80x
# for another CPU's summation order
TOL = {"rtol": 1e-10, "atol": 1e-12}
# cg's implicit product is neumann's (hypergrad.implicit_product) with another solve, and cg
# refuses this student's indefinite Hessian; reinforce needs per-sample inner losses
METHODS = ("unrolled", "darts", "neumann", "sama")


def _net(seed: int, depth: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


class Student(Problem):
    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        out = self(x)
        return ((out - y) ** 2).mean() + 0.5 * ((out - self.teacher(x)) ** 2).mean()


class Teacher(Problem):
    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        return ((self.student(x) - y) ** 2).mean() + 1e-3 * ((self(x) - y) ** 2).mean()


def _data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * BATCH, WIDTH, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x.flip(1)))


def _config(method: str) -> ProblemConfig:
    return ProblemConfig(method=method, unroll_steps=2 if method == "unrolled" else 1)


def train(strategy: str, options: dict[str, Any], method: str) -> dict[str, Tensor]:
    n = metadist.init().world_size
    student, teacher = _net(0, 2), _net(1, 3)
    problems = [
        Student("student", student, torch.optim.SGD(student.parameters(), lr=0.1),
                train_data_loader=DataLoader(_data(2), batch_size=BATCH // n),
                config=_config(method)),
        Teacher("teacher", teacher, torch.optim.Adam(teacher.parameters(), lr=0.01),
                train_data_loader=DataLoader(_data(3), batch_size=BATCH // n))]
    engine = Engine(problems, EngineConfig(strategy=strategy, strategy_options=options,
                                           train_iters=ITERS),
                    {"u2l": {problems[1]: [problems[0]]}, "l2u": {problems[0]: [problems[1]]}})
    engine.run()
    assert engine.problems["teacher"].steps >= 2
    return {f"{p.name}.{k}": v.clone() for p in engine.problems.values()
            for k, v in p.params().items()}


def _all(strategy: str, options: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    return {m: train(strategy, options, m) for m in METHODS}


@pytest.fixture(scope="module")
def want() -> dict[str, dict[str, Tensor]]:
    return run_on_ranks(_all, 1, args=("single", {}))[0]


@pytest.mark.parametrize(("strategy", "n", "nnodes"), [("zero3", 2, 1), ("zero3", 3, 1),
                                                       ("zero3", 4, 1), ("hsdp", 4, 2)])
def test_teacher_hypergradient_on_shards_matches_one_process(
        strategy: str, n: int, nnodes: int, want: dict[str, dict[str, Tensor]]) -> None:
    start = _net(1, 3).state_dict()
    for method, params in want.items():  # the teacher moved: the comparison means something
        moved = max((params[f"teacher.{k}"] - v).abs().max().item() for k, v in start.items())
        assert moved > 1e-4, method
    _assert_close(run_on_ranks(_all, n, nnodes=nnodes, timeout=300, args=(strategy, SHARDED)),
                  want, f"{strategy} n={n}")


def _assert_close(out: list[dict[str, dict[str, Tensor]]], want: dict[str, dict[str, Tensor]],
                  where: str) -> None:
    """Every rank's results (by method, then name) against one process's, at TOL."""
    for rank, got in enumerate(out):
        for method, values in want.items():
            for name, value in values.items():
                torch.testing.assert_close(
                    got[method][name], value, **TOL,
                    msg=lambda m, method=method, name=name, rank=rank:
                    f"{where} rank={rank} {method} {name}: {m}")


# ----- the hypergradient functions with another model's fast weights as hparams -------------
def functional(strategy: str, options: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    """Each method's hypergradient with respect to the teacher's fast weights (whole, by
    name): the same lines under every strategy, each rank on its slice of the batches."""
    from metadist.meta import hypergradient

    s = metadist.strategy(strategy, **options)
    nets = _net(0, 2), _net(1, 3)
    student, _ = s.setup(nets[0], torch.optim.SGD(nets[0].parameters(), lr=0.1))
    teacher, _ = s.setup(nets[1], torch.optim.SGD(nets[1].parameters(), lr=0.1))
    w = metadist.world()
    xt, yt = (t[:BATCH].chunk(w.world_size)[w.rank] for t in _data(2).tensors)
    xv, yv = (t[:BATCH].chunk(w.world_size)[w.rank] for t in _data(3).tensors)

    def inner(fast: Any, lam: Any) -> Tensor:
        out = student.functional_forward(fast, xt)
        return ((out - yt) ** 2).mean() + 0.5 * ((out - teacher.functional_forward(lam, xt))
                                                 ** 2).mean()

    def outer(fast: Any, lam: Any) -> Tensor:
        return ((student.functional_forward(fast, xv) - yv) ** 2).mean()

    sync = s.sync_grads if w.world_size > 1 else None
    out = {}
    for method in ("unrolled", "darts", "neumann"):
        lam = teacher.fast_weights().detach().requires_grad_()
        pieces = hypergradient(method, outer, inner, student.fast_weights(), lam,
                               grad_sync=sync)
        whole = FastWeights(lam.layout, pieces).full()  # the pieces' gradients, gathered
        out[method] = {k: v.detach().clone() for k, v in whole.items()}
    return out


@pytest.mark.parametrize(("strategy", "n", "nnodes"), [("ddp", 2, 1), ("zero3", 2, 1),
                                                       ("zero3", 3, 1), ("hsdp", 4, 2)])
def test_fast_weights_as_hparams_match_one_process(strategy: str, n: int, nnodes: int) -> None:
    """``hparams=teacher.fast_weights()``: the loss functions get fast weights under every
    strategy; under zero3/hsdp they are shards and the result is their pieces' gradients."""
    want = run_on_ranks(functional, 1, args=("single", {}))[0]
    assert all(v.abs().max() > 1e-6 for grads in want.values() for v in grads.values())
    options = SHARDED if strategy != "ddp" else {}
    _assert_close(run_on_ranks(functional, n, nnodes=nnodes, timeout=300,
                               args=(strategy, options)), want, f"{strategy} n={n}")
