"""Misuse a user can trigger gets an error that says what went wrong and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metadist


def test_optimizer_built_on_another_model() -> None:
    net, other = nn.Linear(3, 2), nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"2 tensor\(s\) in the optimizer are not parameters "
                                         r"of the model passed to setup; build the optimizer"):
        metadist.strategy("single").setup(net, torch.optim.SGD(other.parameters(), lr=0.1))


def test_setup_without_an_optimizer_or_with_something_else() -> None:
    s = metadist.strategy("single")
    with pytest.raises(ValueError, match=r"needs the optimizer; for the module alone call "
                                         r"strategy.setup_module"):
        s.setup(nn.Linear(3, 2))
    with pytest.raises(TypeError, match=r"takes a torch\.optim\.Optimizer, got list"):
        s.setup(nn.Linear(3, 2), [1, 2])  # type: ignore[arg-type]


def test_setup_twice_and_optimizer_before_module() -> None:
    s = metadist.strategy("single")
    net = nn.Linear(3, 2)
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already set up by a strategy; pass the original"):
        s.setup(model, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"needs the module returned by strategy\.setup_module"):
        s.setup_optimizer(net, torch.optim.SGD(net.parameters(), lr=0.1))  # type: ignore[arg-type]


def test_input_on_another_device_than_the_model() -> None:
    model = metadist.strategy("single").setup_module(nn.Linear(3, 2))
    meta_input = torch.empty(4, 3, device="meta")  # a device other than the model's
    with pytest.raises(RuntimeError, match=r"the input is on meta but the model is on cpu; "
                                           r"move batches with x.to\(strategy.device\)"):
        model(meta_input)


def test_unknown_strategy_option_and_precision() -> None:
    with pytest.raises(ValueError, match="strategy 'zer2' is not known; choose one of: single"):
        metadist.strategy("zer2")
    with pytest.raises(ValueError, match="has no option"):
        metadist.strategy("ddp", bucket_mb=3)
    with pytest.raises(ValueError, match="precision 'bf16' is not known"):
        metadist.strategy("zero3", precision="bf16")
