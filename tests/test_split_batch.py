"""``strategy.split_batch``: this rank's slice of a global batch, weighted by its share, so a
batch that does not divide by the ranks trains as one process does. The docs' former idiom,
``x.chunk(n)[rank]``, raised a bare IndexError there (6 samples on 4 ranks: 3 chunks), and an
even-looking ``tensor_split`` without the weight gave the unweighted mean of the ranks'
means."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

SAMPLES, STEPS = 6, 10


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 2, generator=g)


def _train(strategy: str, weighted: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    plain = copy.deepcopy(net)
    s = metadist.strategy(strategy, **({"min_unit_params": 10} if strategy == "zero3" else {}))
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    popt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    w = s.world
    for step in range(STEPS):
        x, y = _batch(step)
        if weighted:
            xs, ys = s.split_batch(x, y)
        else:  # the slice alone, no weight: each rank's mean counts alike
            xs, ys = (torch.tensor_split(t, w.world_size)[w.rank] for t in (x, y))
        opt.zero_grad()
        s.backward(nn.functional.mse_loss(model(xs), ys))
        opt.step()
        popt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        popt.step()
    return {"got": model.state_dict(), "want": plain.state_dict()}


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_an_uneven_batch_split_by_the_strategy_trains_as_one_process(strategy: str) -> None:
    for out in run_on_ranks(_train, 4, args=(strategy, True)):
        assert_tensors_close(out["got"], out["want"])


def test_the_same_split_without_the_weight_is_not_one_process() -> None:
    """The control: the check above can fail (the unweighted mean trains elsewhere)."""
    out = run_on_ranks(_train, 4, args=("ddp", False))[0]
    with pytest.raises(AssertionError):
        assert_tensors_close(out["got"], out["want"])


def _too_small() -> str:
    s = metadist.strategy("ddp")
    try:
        s.split_batch(torch.randn(3, 2))
    except ValueError as err:
        return str(err)
    return "split"


def test_a_batch_smaller_than_the_world_is_named() -> None:
    for message in run_on_ranks(_too_small, 4):
        assert "a global batch of 3 sample(s) on 4 ranks leaves a rank without samples" \
            in message
