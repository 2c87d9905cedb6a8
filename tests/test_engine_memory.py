"""The Engine's own first-order steps under zero3/hsdp hold one unit at a time, not the model.

A problem stepping on its own parameters is bound to its shards as fast weights for the whole
``training_step`` (every access path sees them; strategies/sharded_fast.py), so a rank's peak
during the step falls as 1/N like the strategy's own forward. Before, it was bound to
``full_parameters()``: an owned whole copy of the model on every rank for the step. Measured
in bytes of live storages (stable under load), against one process's step.
"""

from __future__ import annotations

from typing import Any

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
# A backward holds a unit's gathered weights and its whole gradient while it runs (two
# units); a finished collective's buffers go back to the allocator when gloo's worker thread
# drops its reference, after it signalled completion, so at the peak up to one more unit per
# worker thread (two) may still be alive: measured here, the peak moves by exactly one unit
# between runs, with the garbage collector off too. The old path's whole copy is 12 units.
SLACK_UNITS = 4


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
