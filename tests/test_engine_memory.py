"""The Engine's own first-order steps under zero3/hsdp hold one unit at a time, not the model.

A problem stepping on its own parameters is bound to its shards as fast weights for the whole
``training_step`` (every access path sees them; strategies/zero3/sharded_fast.py), so a rank's peak
during the step falls as 1/N like the strategy's own forward. Before, it was bound to
``full_parameters()``: an owned whole copy of the model on every rank for the step. Measured
in bytes of live storages (stable under load), against one process's step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from fast_meta import wide_net
from metadist.meta import Engine, EngineConfig, Problem
from metadist.testing import peak_bytes_of, run_on_ranks

WIDE = {"wrap_classes": (nn.Linear,)}
WIDTH, DEPTH, BATCH = 128, 12, 8  # many units: the model, not one unit, dominates the peak
UNIT = WIDTH * (WIDTH + 1) * 4  # one Linear, whole (float32)
# Whole units alive at a backward's peak by design: the unit's gathered weights and the
# next unit's gather started ahead (both buffers of the gather pool,
# strategies/zero3/gather_buffers.py), the unit's whole weight gradient, and the
# concatenated parts a small reduce-scatter reduces in place: four. A finished collective's
# tensors go back to the allocator when gloo's worker thread drops its reference, after it
# signalled completion, so at the peak up to one more unit per worker thread (two) may
# still be alive: measured here, the peak moves by exactly one such unit between runs of
# the same process (the pool's allocations do not change). The old path's whole copy is
# 12 units, more than the bound's 1/N share and these six together.
SLACK_UNITS = 6


class Regression(Problem):
    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        return ((self(x) - y) ** 2).mean()


def _step_peak(strategy: str, options: dict[str, Any]) -> int:
    """Bytes of live storages at the peak of one engine iteration (forward, backward, step)
    after a first one (the optimizer's state exists), above what was alive before it."""
    n = metadist.init().world_size
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCH, WIDTH, generator=g),
                         torch.randn(4 * BATCH, WIDTH, generator=g))
    net = wide_net(WIDTH, DEPTH)
    problem = Regression("regression", net, torch.optim.SGD(net.parameters(), lr=0.01,
                                                            momentum=0.9),
                         train_data_loader=DataLoader(data, batch_size=BATCH // n))
    engine = Engine([problem], EngineConfig(strategy=strategy, strategy_options=options,
                                            train_iters=2))
    engine.train_step()
    return peak_bytes_of(engine.train_step)[1]


def test_an_engine_step_under_zero3_holds_a_unit_at_a_time() -> None:
    one = run_on_ranks(_step_peak, 1, args=("ddp", {}))[0]
    for strategy, n, nnodes, factor in (("zero3", 4, 1, 4), ("hsdp", 4, 2, 2)):
        peak = max(run_on_ranks(_step_peak, n, nnodes=nnodes, timeout=300,
                                args=(strategy, WIDE)))
        bound = 1.2 * one / factor + SLACK_UNITS * UNIT
        assert peak <= bound, (f"{strategy} N={n}: peak {peak} B per rank over the bound "
                               f"{bound:.0f} B (one process: {one} B, one unit: {UNIT} B)")


# ----- an upper problem's hypergradient: the upper model as shard pieces --------------------
class Student(Problem):
    """Fits the data and the teacher's outputs: the teacher's parameters are hyperparameters
    of this loss, reached through the teacher's forward (one unit at a time)."""

    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        out = self(x)
        return ((out - y) ** 2).mean() + ((out - self.teacher(x)) ** 2).mean()


class Teacher(Problem):
    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        return ((self.student(x) - y) ** 2).mean()


def _hypergradient_peak(strategy: str, options: dict[str, Any], method: str) -> int:
    """Bytes of live storages at the peak of the teacher's hypergradient (through the
    student's response, ``method``), after one whole iteration, above what was alive
    before it."""
    from metadist.meta import ProblemConfig

    n = metadist.init().world_size
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCH, WIDTH, generator=g),
                         torch.randn(4 * BATCH, WIDTH, generator=g))
    student, teacher = wide_net(WIDTH, 2), wide_net(WIDTH, DEPTH)
    problems = [Student("student", student, torch.optim.SGD(student.parameters(), lr=0.01),
                        train_data_loader=DataLoader(data, batch_size=BATCH // n),
                        config=ProblemConfig(method=method)),
                Teacher("teacher", teacher, torch.optim.SGD(teacher.parameters(), lr=0.01),
                        train_data_loader=DataLoader(data, batch_size=BATCH // n))]
    engine = Engine(problems, EngineConfig(strategy=strategy, strategy_options=options,
                                           train_iters=2),
                    {"u2l": {problems[1]: [problems[0]]}, "l2u": {problems[0]: [problems[1]]}})
    engine.train_step()
    upper = engine.problems["teacher"]
    upper.batch = upper.next_batch()
    return peak_bytes_of(lambda: engine._hypergradient(upper))[1]


@pytest.mark.parametrize("method", ["darts", "neumann"])
def test_an_upper_problems_hypergradient_holds_its_model_as_shards(method: str) -> None:
    """Before, the teacher's parameters entered the hypergradient as whole clones on every
    rank, with whole gradients: at 4 ranks zero3 peaked at 1.14 times ddp's peak for darts
    and 1.33 times for neumann, hsdp 1.17 and 1.36; now as this rank's shard pieces (zero3
    0.21 and 0.22, hsdp 0.41 and 0.43). Against ddp at the same world size, whose synced
    gradients (the direct part, both sides of darts' difference, their averages) are as
    many as the pieces' but whole."""
    ddp = max(run_on_ranks(_hypergradient_peak, 4, timeout=300, args=("ddp", {}, method)))
    for strategy, nnodes, factor in (("zero3", 1, 4), ("hsdp", 2, 2)):
        peak = max(run_on_ranks(_hypergradient_peak, 4, nnodes=nnodes, timeout=300,
                                args=(strategy, WIDE, method)))
        bound = 1.2 * ddp / factor + SLACK_UNITS * UNIT
        assert peak <= bound, (f"{method} {strategy}: peak {peak} B per rank over the bound "
                               f"{bound:.0f} B (ddp at 4 ranks: {ddp} B, one unit: {UNIT} B)")
