"""Ranks agree on what must be equal, or every rank stops naming the difference
(strategies/agreement.py), and the bad inputs that passed silently stop at once.

Reproductions (2 ranks; before this change): a learning rate or momentum set per rank trained
silently (ddp: replicas 0.63 apart; zero2/zero3: 0.15 / 0.59 off); a model of another shape
on rank 1 aborted in gloo ("Received data size doesn't match"); the same module set up twice
trained 11.1% off one process (zero2), or said its parameters were "on the meta device"
(zero3); ``reduce_dtype=torch.int32`` trained 6.0e-2 off, ``bucket_cap_mb=nan`` failed in
setup with "cannot convert float NaN to integer"; an Adam checkpoint loaded into SGD gave the
groups Adam's hyperparameters and the first step raised ``KeyError: 'momentum'``; an input's
gradient through a set-up model was told to "set the model up".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.checkpoint.errors import CheckpointMismatchError
from metadist.testing import run_on_ranks

OPTIONS = {"ddp": {}, "zero2": {}, "zero3": {"min_unit_params": 10}}


def _net(hidden: int = 16, extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2)]
    return nn.Sequential(*layers, *([nn.Tanh(), nn.Linear(2, 2)] if extra else []))


def _setup(strategy: str, case: str) -> str:
    """The error every rank raises at setup, for a program that differs on rank 1."""
    odd = metadist.world().rank == 1
    options: dict[str, Any] = dict(OPTIONS[strategy])
    net = _net(17 if case == "hidden" and odd else 16, extra=case == "layer" and odd)
    if case == "lr":
        opt: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=0.02 if odd else 0.01)
    elif case == "momentum":
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5 if odd else 0.9)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if case == "option":
        options = {"bucket_cap_mb": 2.0 if odd else 1.0}
    try:
        metadist.strategy(strategy, **options).setup(net, opt)
    except ValueError as exc:
        return str(exc)
    return "set up"


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
@pytest.mark.parametrize(("case", "says"), [
    ("lr", "param group 0 lr, but rank 0 has 0.01 and rank 1 has 0.02"),
    ("momentum", "param group 0 momentum, but rank 0 has 0.9 and rank 1 has 0.5"),
    ("hidden", "parameter '0.weight', but rank 0 has shape (16, 4)"),
    ("layer", "parameter '4.weight', but rank 0 has nothing (no such item) and rank 1 has "
              "shape (2, 2)")])
def test_a_difference_between_ranks_stops_every_rank_naming_it(strategy: str, case: str,
                                                               says: str) -> None:
    for message in run_on_ranks(_setup, 2, args=(strategy, case)):
        assert says in message and "on every rank" in message, message


def test_a_strategy_option_set_per_rank_stops() -> None:
    for message in run_on_ranks(_setup, 2, args=("ddp", "option")):
        assert "option bucket_cap_mb, but rank 0 has 1.0 and rank 1 has 2.0" in message


def _twice(first: str, second: str) -> str:
    net = _net()
    metadist.strategy(first, **OPTIONS[first]).setup(net, torch.optim.SGD(net.parameters(),
                                                                           lr=0.1))
    try:
        metadist.strategy(second, **OPTIONS[second]).setup(
            net, torch.optim.SGD(net.parameters(), lr=0.1))
    except ValueError as exc:
        return str(exc)
    return "set up twice"


@pytest.mark.parametrize(("first", "second"), [("zero2", "zero2"), ("zero2", "ddp"),
                                               ("zero3", "zero3")])
def test_a_module_set_up_twice_stops_naming_the_first_setup(first: str, second: str) -> None:
    for message in run_on_ranks(_twice, 2, args=(first, second)):
        assert f"set up already, by strategy '{first}'" in message, message


@pytest.mark.parametrize(("strategy", "option", "value", "says"), [
    ("zero3", "reduce_dtype", torch.int32, "not a floating dtype"),
    ("ddp", "reduce_dtype", torch.int64, "not a floating dtype"),
    ("zero3", "param_dtype", torch.int8, "not a floating dtype"),
    ("ddp", "bucket_cap_mb", math.nan, "bucket_cap_mb must be a finite positive"),
    ("zero2", "bucket_cap_mb", math.inf, "bucket_cap_mb must be a finite positive"),
    ("zero1", "first_bucket_mb", -1.0, "first_bucket_mb must be a finite positive")])
def test_option_values_that_cannot_work_are_refused(strategy: str, option: str, value: Any,
                                                    says: str) -> None:
    with pytest.raises(ValueError, match=says):
        metadist.strategy(strategy, **{option: value})


def _reload(path: str, saved: str, loaded: str) -> str:
    s = metadist.strategy("ddp")
    net = _net()
    optimizers = {"Adam": lambda p: torch.optim.Adam(p, lr=0.01),
                  "SGD": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
                  "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.5)}
    model, opt = s.setup(net, optimizers[saved](net.parameters()))
    opt.zero_grad()
    s.backward(model(torch.randn(4, 4)).square().mean())
    opt.step()
    s.save(path, {"model": model, "optimizer": opt})
    other = _net()
    model2, opt2 = metadist.strategy("ddp").setup(other, optimizers[loaded](other.parameters()))
    try:
        s.load(path, {"model": model2, "optimizer": opt2})
    except CheckpointMismatchError as exc:
        return str(exc)
    return f"loaded; lr {opt2.param_groups[0]['lr']}"


@pytest.mark.parametrize("loaded", ["SGD", "RMSprop"])
def test_a_checkpoint_of_another_optimizer_class_is_refused(tmp_path: Path,
                                                           loaded: str) -> None:
    for message in run_on_ranks(_reload, 2, args=(str(tmp_path / "ckpt"), "Adam", loaded)):
        assert f"which {loaded} does not take" in message and "betas" in message, message
    same = run_on_ranks(_reload, 2, args=(str(tmp_path / "again"), "SGD", "SGD"))
    assert same == ["loaded; lr 0.5"] * 2


def _input_gradient(strategy: str) -> str:
    net = _net().requires_grad_(False)
    s = metadist.strategy(strategy, **OPTIONS[strategy])
    model = s.setup_module(net)
    x = torch.randn(4, 4, requires_grad=True)
    try:
        s.backward(model(x).square().sum())
    except RuntimeError as exc:
        return str(exc)
    return "ran"


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_an_input_gradient_is_told_what_happened(strategy: str) -> None:
    for message in run_on_ranks(_input_gradient, 2, args=(strategy,)):
        assert "reaches no parameter, only tensor(s) that are not parameters" in message
        assert "torch.autograd.grad(loss, x)" in message


def _loader(odd_length: int) -> str:
    from torch.utils.data import DataLoader, TensorDataset

    n = odd_length if metadist.world().rank == 1 else 64
    loader = DataLoader(TensorDataset(torch.randn(n, 4)), batch_size=8)
    try:
        metadist.strategy("ddp").setup_dataloader(loader)
    except ValueError as exc:
        return str(exc)
    return "distributed"


def test_a_dataset_of_another_length_on_one_rank_stops() -> None:
    """Before: 48 samples on rank 1 and 64 on rank 0 trained 0.088 off one process."""
    for message in run_on_ranks(_loader, 2, args=(48,)):
        assert "dataset length, but rank 0 has 64 and rank 1 has 48" in message, message
    assert run_on_ranks(_loader, 2, args=(64,)) == ["distributed"] * 2


def _train(strategy: str, change: str) -> str:
    w = metadist.world()
    net = _net()
    s = metadist.strategy(strategy, **OPTIONS[strategy])
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    try:
        for step in range(6):
            opt.zero_grad()
            s.backward(model(torch.randn(8, 4)).square().mean())
            if change == "lr" and step == 3 and w.rank == 1:
                opt.param_groups[0]["lr"] = 0.3  # a per-rank change after setup
            if change == "skip" and step == 3 and w.rank == 1:
                continue
            opt.step()
            sched.step()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"trained; lr {opt.param_groups[0]['lr']}"


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_learning_rate_changed_on_one_rank_stops_at_the_next_step(strategy: str) -> None:
    """A scheduler changing it on every rank alike trains; one rank's change stops."""
    assert run_on_ranks(_train, 2, args=(strategy, "none")) == ["trained; lr 0.0125"] * 2
    for message in run_on_ranks(_train, 2, args=(strategy, "lr")):
        assert "param group 0 lr, but rank 0 has 0.05 and rank 1 has 0.3" in message, message


def _diverge(strategy: str, change: str) -> str:
    """Rank 1 skips optimizer.step() #4, or runs a second backward before it."""
    w = metadist.world()
    net = _net()
    s = metadist.strategy(strategy, **OPTIONS[strategy])
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    for step in range(6):
        opt.zero_grad()
        s.backward(model(torch.randn(8, 4)).square().mean())
        if change == "twice" and step == 3 and w.rank == 1:
            s.backward(model(torch.randn(8, 4)).square().mean())
        if change == "skip" and step == 3 and w.rank == 1:
            continue
        opt.step()
    return "trained"


@pytest.mark.parametrize("change", ["skip", "twice"])
def test_a_skipped_step_or_an_extra_backward_under_ddp_stops_naming_it(change: str) -> None:
    """Before: a skipped step trained on with the replicas 0.15 apart (exit 0), then aborted
    in gloo once the step agreement ran on the world group; an extra backward paired its
    all-reduce with the other rank's next step and aborted."""
    with pytest.raises(metadist.RankFailedError) as info:
        run_on_ranks(_diverge, 2, args=("ddp", change))
    text = str(info.value)
    assert "optimizer.step() #4 under 'ddp': the ranks must have made the same number of " \
           "backward passes since optimizer.step() #3, but rank 0 made 1 and rank 1 made 2" \
           in text, text
    assert "a rank that skips a step or runs an extra backward" in text
    assert run_on_ranks(_diverge, 2, args=("ddp", "none")) == ["trained"] * 2


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_skipped_step_under_zero_is_named_a_diverged_program(strategy: str) -> None:
    """zero2/zero3's step gathers parameters, which a rank that skipped it pairs with its
    next backward's reductions: the watchdog names the rank past that call number with
    another operation. Before: "every rank entered it, yet it did not complete (a backend or
    network problem ...)"."""
    with pytest.raises(metadist.RankFailedError) as info:
        metadist.launch(_diverge, 2, args=(strategy, "skip"), timeout=120,
                        collective_timeout=3)
    text = str(info.value)
    assert "instead: the ranks' programs diverged" in text, text
    assert "backend or network problem" not in text


def _save_diverged(path: str) -> str:
    s = metadist.strategy("ddp")
    net = _net()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    opt.zero_grad()
    s.backward(model(torch.randn(4, 4)).square().mean())
    opt.step()
    if metadist.world().rank == 1:
        with torch.no_grad():  # a change of one rank's replica outside the optimizer
            model.module[2].weight.add_(1.0)
    try:
        s.save(path, {"model": model, "optimizer": opt})
    except metadist.CheckpointError as exc:
        return str(exc)
    return "saved"


def test_a_save_of_replicas_that_diverged_is_refused(tmp_path: Path) -> None:
    """Before: the sharded checkpoint held '0.weight' from rank 0 and '2.weight' from rank 1,
    matching neither replica."""
    for message in run_on_ranks(_save_diverged, 2, args=(str(tmp_path / "ckpt"),)):
        assert "['2.weight'] must be equal on every rank under 'ddp'" in message, message
        assert "rank 1's differs from rank 0's" in message
    assert not (tmp_path / "ckpt" / "metadata.json").exists()
