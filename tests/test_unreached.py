""""No gradient" stays "no gradient" under every strategy: a parameter that no loss reached in
a step ends the backward with no gradient where one process would, so the optimizer skips it
(no weight decay, no momentum, no Adam step), also inside zero3/hsdp's flat shards, through
no_sync accumulation, and across ranks: reached on some ranks only, it is reached (the
global gradient exists). Where a flat shard cannot skip one parameter exactly (its optimizer
keeps one step count for the whole shard), the step stops with an error before it changes
anything."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.testing import run_on_ranks
from parity import ATOL, RTOL

STEPS, BATCH, THRESHOLD = 10, 24, 1.6


class Routed(nn.Module):
    """``early`` runs at step 0 only, ``rare`` on the samples whose first feature exceeds a
    threshold (some steps none, some steps on one rank's half only), ``never`` not at all."""

    def __init__(self, rare: bool = True) -> None:
        super().__init__()
        self.use_rare = rare
        self.inp = nn.Linear(6, 8)
        self.early = nn.Linear(8, 8)
        self.rare = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if step == 0:
            h = h + self.early(h)
        picked = (x[:, 0] > THRESHOLD).nonzero().squeeze(1)
        if picked.numel() and self.use_rare:
            h = h.index_add(0, picked, torch.tanh(self.rare(h[picked])))
        return self.out(h)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g))
            for _ in range(STEPS)]


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.05)


def _net(rare: bool = True) -> Routed:
    torch.manual_seed(0)
    return Routed(rare)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _reference(optimizer: str, rare: bool = True) -> dict[str, torch.Tensor]:
    net = _net(rare)
    opt = _optimizer(optimizer, net.parameters())
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        # two micro-batches, as the ranks accumulate them (the mean of the means)
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            (_loss(net(xs, step), ys) / 2).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _train(strategy: str, options: dict[str, Any], optimizer: str,
           rare: bool = True) -> dict[str, torch.Tensor]:
    """This rank's slice of every global batch, as two micro-batches (the first under
    no_sync), each micro-batch of every rank together being one micro-batch of the
    reference."""
    w = metadist.world()
    net = _net(rare)
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, _optimizer(optimizer, net.parameters()))
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        halves = list(zip(x.chunk(2), y.chunk(2), strict=True))
        for j, (xs, ys) in enumerate(halves):
            per = xs.shape[0] // w.world_size
            mine = slice(w.rank * per, (w.rank + 1) * per)
            loss = _loss(model(xs[mine], step), ys[mine]) / 2
            if j == 0:
                with s.no_sync(model):
                    s.backward(loss)
            else:
                s.backward(loss)
        opt.step()
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


def test_the_data_reaches_rare_on_some_steps_and_ranks_only() -> None:
    """The scenarios below happen: a step where no sample takes the rare branch, and one
    where only one rank's samples of a micro-batch do."""
    none = one_rank = 0
    for x, _ in _data():
        picked = [(h[:, 0] > THRESHOLD).view(2, -1).any(1) for h in x.chunk(2)]
        none += not any(bool(p.any()) for p in picked)
        one_rank += any(int(p.sum()) == 1 for p in picked)
    assert none and one_rank


CASES = [("ddp", {}, 2), ("zero1", {}, 2), ("zero2", {"bucket_cap_mb": 0.0005}, 2),
         ("zero3", {}, 2), ("zero3", {"min_unit_params": 1000}, 3), ("hsdp", {}, 2)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(("strategy", "options", "world"), CASES)
def test_unreached_parameters_are_skipped_as_in_one_process(
        strategy: str, options: dict[str, Any], world: int, optimizer: str) -> None:
    # zero3/hsdp with Adam: a parameter skipped and reached again cannot get its own step
    # count inside a flat shard (the last test); early and never are skipped exactly.
    rare = optimizer == "sgd" or strategy not in ("zero3", "hsdp")
    want = _reference(optimizer, rare)
    nnodes = 2 if strategy == "hsdp" else 1
    # 24 samples: each micro-batch of 12 splits evenly over 2 ranks and over 3
    for rank, got in enumerate(run_on_ranks(_train, world, nnodes=nnodes,
                                            args=(strategy, options, optimizer, rare))):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name, r=rank: f"{strategy} rank {r} "
                                                                     f"{n}: {m}")


def _adam_state(strategy: str, options: dict[str, Any], path: str | None
                ) -> dict[str, Any]:
    """zero3-style Adam training without the rare branch; returns the consolidated optimizer
    state, and saves a checkpoint in both formats if ``path``."""
    w = metadist.world()
    net = _net(rare=False)
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, _optimizer("adam", net.parameters()))
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        per = x.shape[0] // w.world_size
        mine = slice(w.rank * per, (w.rank + 1) * per)
        s.backward(_loss(model(x[mine], step), y[mine]))
        opt.step()
    if path is not None:
        for fmt in ("sharded", "full"):
            s.save(f"{path}/{fmt}", {"model": model, "optimizer": opt}, format=fmt)
    full = s.optimizer_state_dict(opt)
    assert full is not None
    return full


def _one_process_adam_state() -> dict[str, Any]:
    net = _net(rare=False)
    opt = _optimizer("adam", net.parameters())
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        _loss(net(x, step), y).backward()
        opt.step()
    return opt.state_dict()


def _assert_same_state(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    # early (indices 2, 3) was stepped once, at step 0; rare (4, 5) and never (6, 7) never
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1, 2, 3, 8, 9], where
    for i, entry in want["state"].items():
        assert sorted(got["state"][i]) == sorted(entry), where
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, j=i: f"{where} {j}.{k}: {m}")


def _resume(strategy: str, options: dict[str, Any], path: str, fmt: str
            ) -> tuple[dict[str, Any], str]:
    """Load the checkpoint (another world size), consolidate, then take a step that reaches
    ``early`` again: one process would step it with its own Adam step count (1), the flat
    shard holds 11."""
    w = metadist.world()
    net = _net(rare=False)
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, _optimizer("adam", net.parameters()))
    s.load(f"{path}/{fmt}", {"model": model, "optimizer": opt})
    full = s.optimizer_state_dict(opt)
    assert full is not None
    x, y = _data()[0]
    per = x.shape[0] // w.world_size
    mine = slice(w.rank * per, (w.rank + 1) * per)
    s.backward(_loss(model(x[mine], 0), y[mine]))  # step 0's branch: early is reached
    try:
        opt.step()
    except RuntimeError as e:
        return full, str(e)
    return full, ""


@pytest.mark.parametrize(("strategy", "options", "world"),
                         [("zero3", {}, 2), ("hsdp", {}, 2)])
def test_skipped_parameters_keep_one_process_state_through_checkpoints(
        tmp_path: Any, strategy: str, options: dict[str, Any], world: int) -> None:
    """Adam's per-parameter step count of a parameter the steps skipped stays where one
    process left it: in the consolidated state, in both checkpoint formats, loaded at
    another world size; and when a gradient reaches it again, the step refuses."""
    want = _one_process_adam_state()
    nnodes = 2 if strategy == "hsdp" else 1
    for rank, got in enumerate(run_on_ranks(_adam_state, world, nnodes=nnodes,
                                            args=(strategy, options, str(tmp_path)))):
        _assert_same_state(got, want, f"{strategy} rank {rank}")
    for fmt in ("sharded", "full"):
        for rank, (got, error) in enumerate(run_on_ranks(
                _resume, 3, args=("zero3", {}, str(tmp_path), fmt))):
            _assert_same_state(got, want, f"{strategy} -> zero3 x3 {fmt} rank {rank}")
            assert "early.weight, early.bias got a gradient again" in error, error
            assert "unit of its own" in error


def test_a_skipped_parameter_reached_again_stops_the_step_before_it_changes_anything() -> None:
    """zero3 + Adam + the rare branch: the first step that reaches ``rare`` after a step
    skipped it raises on every rank, naming it and the remedies."""
    with pytest.raises(metadist.RankFailedError) as info:
        run_on_ranks(_train, 2, args=("zero3", {}, "adam", True))
    message = info.value.remote_message
    assert "rare.weight, rare.bias got a gradient again" in message, message
    assert "wrap_classes" in message and "zero1" in message
