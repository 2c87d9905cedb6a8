"""Random draws in validation, which runs on rank 0 alone.

Reproduction (found porting Betty's SANAS example, whose training draws an attack's random
start after a validation that iterated a DataLoader): ``iter(loader)`` draws the loader's
base seed from torch's global generator, so validation moved rank 0's generator and not the
others'; from there on rank 1 drew other numbers than one process draws, silently. Now every
rank whose generators were rank 0's before validation continues from rank 0's after it
(torch's, Python's and numpy's); a rank seeded apart keeps its own stream.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import peers


def _draws(strategy: str, seed_apart: bool = False) -> list[tuple[float, float, float]]:
    """What the lower problem draws in each of its training steps (6 steps, each with two
    more in the upper's darts hypergradient; validation every 2 iterations draws from
    torch's, Python's and numpy's generators), in a Betty program on the drop-in."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from metadist.compat.betty.configs import Config, EngineConfig
    from metadist.compat.betty.engine import Engine
    from metadist.compat.betty.problems import ImplicitProblem

    peers.use()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    data = TensorDataset(torch.randn(16, 2, dtype=torch.float64),
                         torch.randn(16, 1, dtype=torch.float64))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if seed_apart:  # each rank its own stream, on purpose
        torch.manual_seed(100 + torch.distributed.get_rank())
    draws: list[tuple[float, float, float]] = []

    class Lower(ImplicitProblem):  # type: ignore[misc]
        def training_step(self, batch: Any) -> torch.Tensor:
            draws.append((torch.rand(()).item(), random.random(), float(np.random.rand())))
            x, y = batch
            return ((self.module(x) - y) ** 2).mean() + self.upper.module.weight.sum()

    class Upper(ImplicitProblem):  # type: ignore[misc]
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return ((self.lower.module(x) - y) ** 2).mean()

    class Validating(Engine):  # type: ignore[misc]
        def validation(self) -> dict[str, float]:
            for _ in DataLoader(data, batch_size=8):  # iter(): a draw of the base seed
                pass
            return {"r": random.random() + float(np.random.rand())}

    def loader() -> DataLoader[Any]:
        return DataLoader(data, batch_size=8 // world, shuffle=True)

    net, weight = nn.Linear(2, 1).double(), nn.Linear(1, 1, bias=False).double()
    lower = Lower(name="lower", module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                  train_data_loader=loader(), config=Config(type="darts"))
    upper = Upper(name="upper", module=weight,
                  optimizer=torch.optim.SGD(weight.parameters(), lr=0.1),
                  train_data_loader=loader(), config=Config())
    engine = Validating(problems=[upper, lower],
                        config=EngineConfig(strategy=strategy, train_iters=6, valid_step=2),
                        dependencies={"u2l": {upper: [lower]}, "l2u": {lower: [upper]}})
    engine.run()
    return draws


@pytest.mark.parametrize("strategy", ["distributed", "zero", "fsdp"])
def test_ranks_draw_after_validation_what_one_process_draws(strategy: str) -> None:
    one = peers.run_on(1, _draws, ("default",))[0]
    assert len(one) == 18 and len(set(one)) == 18
    for rank, got in enumerate(peers.run_on(2, _draws, (strategy,))):
        assert got == one, f"rank {rank} drew {got}, one process {one}"


def test_a_rank_seeded_apart_keeps_its_own_stream() -> None:
    """Rank 1 seeded apart (torch's generator) is not given rank 0's: its torch draws stay
    its own, those of the generators it shares with rank 0 follow rank 0's."""
    ranks = peers.run_on(2, _draws, ("distributed", True))
    torch_draws = [[d[0] for d in r] for r in ranks]
    assert torch_draws[0] != torch_draws[1]
    assert [d[1:] for d in ranks[0]] == [d[1:] for d in ranks[1]]
