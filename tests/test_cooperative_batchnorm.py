"""BatchNorm in a cooperative inner problem (``model.fast_weights()``): one problem whose
batch the ranks of a group split, so batch statistics must be the group's
(strategies/cooperative.py).

* With ``sync_batchnorm=True`` second-order MAML equals one process on the whole batch
  under ddp, zero3 and hsdp 2x2, where the statistics are the node's (its task's), not the
  world's (before: hsdp's reduced over both nodes, mixing two tasks, silently), also when
  activation checkpointing recomputes the layer in backward, outside the forward's block.
* A plain BatchNorm with batch statistics raises, naming ``sync_batchnorm=True`` (before:
  zero3 silently normalised each rank's slice by itself; ddp stopped in autograd with an
  in-place error that named nothing).
* Under hsdp a layer that would update its running statistics raises: replica groups run
  their tasks at once, one process runs them one after another.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

WIDTH, TASKS, SHOTS, INNER_STEPS, LR, STEPS = 6, 2, 12, 2, 0.1, 10
UNITS = {"wrap_classes": (nn.Linear,)}


def _net(track: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH, track_running_stats=track),
                         nn.Tanh(), nn.Linear(WIDTH, 1))


def _tasks(step: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(10 + step)
    out = []
    for _ in range(TASKS):
        x = torch.randn(2 * SHOTS, WIDTH, generator=g)
        y = torch.sin(x.sum(1, keepdim=True))
        out.append((x[:SHOTS], y[:SHOTS], x[SHOTS:], y[SHOTS:]))
    return out


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _reference(track: bool) -> dict[str, torch.Tensor]:
    net = _net(track)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        for xs, ys, xq, yq in _tasks(step):
            fast = dict(net.named_parameters())
            for _ in range(INNER_STEPS):
                inner = _mse(functional_call(net, fast, (xs,)), ys)
                grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
                fast = {n: p - LR * g for (n, p), g in zip(fast.items(), grads, strict=True)}
            total = total + _mse(functional_call(net, fast, (xq,)), yq) / TASKS
        total.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train(strategy: str, options: dict[str, Any], track: bool) -> Any:
    s = metadist.strategy(strategy, **options)
    net = _net(track)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    try:
        for step in range(STEPS):
            opt.zero_grad()
            start = model.fast_weights()
            per = TASKS // start.groups
            mine = _tasks(step)[start.group_index * per:(start.group_index + 1) * per]
            total = torch.zeros(())
            for task in mine:
                xs, ys, xq, yq = (t.chunk(start.group_size)[start.group_rank] for t in task)
                fast = start
                for _ in range(INNER_STEPS):
                    fast = fast - LR * fast.grad(_mse(model.functional_forward(fast, xs), ys))
                total = total + _mse(model.functional_forward(fast, xq), yq) / len(mine)
            s.backward(total)
            opt.step()
    except RuntimeError as e:
        return str(e)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("strategy", "n", "nnodes", "options", "track"), [
    ("ddp", 2, 1, {}, True), ("zero3", 2, 1, UNITS, True), ("zero3", 3, 1, UNITS, False),
    ("hsdp", 4, 2, UNITS, False),
    ("hsdp", 4, 2, {**UNITS, "activation_checkpointing": nn.BatchNorm1d}, False)])
def test_synchronised_batchnorm_in_a_cooperative_problem_equals_one_process(
        strategy: str, n: int, nnodes: int, options: dict[str, Any], track: bool) -> None:
    want = _reference(track)
    out = run_on_ranks(_train, n, nnodes=nnodes, timeout=300,
                       args=(strategy, {**options, "sync_batchnorm": True}, track))
    for rank, got in enumerate(out):
        assert not isinstance(got, str), got
        assert_tensors_close(got, want, f"{strategy} n={n} rank={rank}")


@pytest.mark.parametrize(("strategy", "n", "nnodes", "options", "track", "says"), [
    ("ddp", 2, 1, {}, True, "sync_batchnorm=True"),
    ("zero3", 2, 1, UNITS, False, "sync_batchnorm=True"),
    ("hsdp", 4, 2, {**UNITS, "sync_batchnorm": True}, True, "track_running_stats=False")])
def test_batchnorm_that_would_differ_raises(strategy: str, n: int, nnodes: int,
                                            options: dict[str, Any], track: bool,
                                            says: str) -> None:
    for message in run_on_ranks(_train, n, nnodes=nnodes, timeout=300,
                                args=(strategy, options, track)):
        assert isinstance(message, str) and "BatchNorm" in message and says in message, message
