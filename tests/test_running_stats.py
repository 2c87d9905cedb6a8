"""Running statistics and buffers on several ranks (strategies/batchnorm/running_stats.py,
strategies/ddp.py's buffer broadcast, strategies/fast_weights.py's uneven slices).

* Each rank's own batches update the running statistics as one process running the ranks'
  batches in rank order: per-rank tasks, ``momentum=None``'s cumulative average, and a
  data-parallel step with ``sync_batchnorm=False`` (micro-batches), num_batches_tracked too.
* The buffer broadcast before a forward leaves a graph that saved a buffer valid (before: a
  double backward stopped with "modified by an inplace operation").
* A forward that reads running statistics with updates not yet combined stops, naming
  ``sync_running_stats``; so does a layer updated both from the global batch and a rank's own.
* A cooperative inner problem's slices of different sizes weigh each sample as one process
  does (before: the README's ``chunk`` idiom on 10 samples over 3 ranks trained 3.7e-2 away).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

STEPS, TASKS, LR = 10, 6, 0.05


def _net(momentum: float | None = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Tanh(),
                         nn.Linear(8, 2))


def _tasks(step: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g),
             torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g))
            for _ in range(TASKS)]


def _maml_loss(forward: Any, params: dict[str, torch.Tensor],
               tasks: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        grads = torch.autograd.grad(F.mse_loss(forward(params, xs), ys), list(params.values()),
                                    create_graph=True)
        fast = {n: p - 0.3 * g for (n, p), g in zip(params.items(), grads, strict=True)}
        total = total + F.mse_loss(forward(fast, xq), yq)
    return total / len(tasks)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _one_process_maml(momentum: float | None) -> dict[str, torch.Tensor]:
    net = _net(momentum)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        _maml_loss(lambda p, x: functional_call(net, p, (x,)), dict(net.named_parameters()),
                   _tasks(step)).backward()
        opt.step()
    return _state(net)


def _maml_on_rank(strategy: str, momentum: float | None) -> dict[str, torch.Tensor]:
    w = metadist.world()
    net = _net(momentum)
    model, opt = metadist.strategy(strategy).setup(net, torch.optim.SGD(net.parameters(),
                                                                        lr=LR))
    per = TASKS // w.world_size
    for step in range(STEPS):
        opt.zero_grad()
        _maml_loss(model.functional_forward, model.full_parameters(),
                   _tasks(step)[w.rank * per:(w.rank + 1) * per]).backward()
        opt.step()
    return _state(model)


@pytest.mark.parametrize(("strategy", "n", "momentum"), [
    ("ddp", 3, None), ("zero2", 2, None), ("zero3", 3, 0.1)])
def test_per_rank_tasks_update_running_statistics_as_one_process(
        strategy: str, n: int, momentum: float | None) -> None:
    """``momentum=None`` (the average over every batch: its weights depend on the count of
    the batches before, other ranks' included) and a fixed momentum."""
    want = _one_process_maml(momentum)
    got = run_on_ranks(_maml_on_rank, n, args=(strategy, momentum))
    for rank, state in enumerate(got):
        assert_tensors_close(state, want, f"{strategy} momentum={momentum} rank {rank}")
        assert int(state["1.num_batches_tracked"]) == STEPS * TASKS * 2


def _micro_batches_on_rank() -> dict[str, torch.Tensor]:
    """A data-parallel step with sync_batchnorm=False: each rank's slice a batch of its own."""
    w = metadist.world()
    net = _net()
    s = metadist.strategy("ddp", sync_batchnorm=False)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    for step in range(STEPS):
        x, y = _tasks(step)[0][:2]
        opt.zero_grad()
        mine = slice(w.rank * 2, (w.rank + 1) * 2)
        s.backward(F.mse_loss(model(x[mine]), y[mine]))
        opt.step()
    return _state(model)


def test_each_ranks_batch_updates_running_statistics_in_rank_order() -> None:
    """One process accumulating the ranks' slices as micro-batches (before: rank 0's alone)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _tasks(step)[0][:2]
        opt.zero_grad()
        for r in range(3):
            (F.mse_loss(net(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]) / 3).backward()
        opt.step()
    for rank, state in enumerate(run_on_ranks(_micro_batches_on_rank, 3)):
        assert_tensors_close(state, _state(net), f"rank {rank}")


class _Scaled(nn.Module):
    """Buffers autograd saves (the products' backward reads them), broadcast each forward
    (two: broadcast in one bucket and written back)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))
        self.register_buffer("gain", torch.linspace(1.5, 0.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * self.gain) * self.scale


def _penalty_objective(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty (double backward), then another forward before the backward."""
    loss = model(x[:3]).square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return loss + sum(g.square().sum() for g in grads) + model(x[3:]).square().mean()


def _penalty_on_rank() -> dict[str, torch.Tensor]:
    w = metadist.world()
    net = _Scaled()
    s = metadist.strategy("ddp")
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(step))[w.rank]
        s.backward(_penalty_objective(model, x))
        opt.step()
    return _state(model)


def test_the_buffer_broadcast_keeps_a_double_backwards_graph() -> None:
    net = _Scaled()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        xs = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(step))
        (sum(_penalty_objective(net, x) for x in xs) / 2).backward()
        opt.step()
    for rank, state in enumerate(run_on_ranks(_penalty_on_rank, 2)):
        assert_tensors_close(state, _state(net), f"rank {rank}")


def _read_before_combining(sync_first: bool) -> Any:
    net = _net()
    model, _ = metadist.strategy("ddp").setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    w = metadist.world()
    xs = _tasks(0)[w.rank][0]
    model.functional_forward(model.full_parameters(), xs)  # a per-rank task: recorded
    if sync_first:
        model.sync_running_stats()
    model.eval()
    try:
        return model(xs).detach()
    except RuntimeError as exc:
        return str(exc)


def test_reading_running_statistics_before_they_are_combined_stops() -> None:
    for message in run_on_ranks(_read_before_combining, 2, args=(False,)):
        assert isinstance(message, str) and "sync_running_stats()" in message, message
    net = _net()
    with torch.no_grad():  # one process: rank 0's task, then rank 1's, then evaluation
        for r in range(2):
            net(_tasks(0)[r][0])
    for rank, out in enumerate(run_on_ranks(_read_before_combining, 2, args=(True,))):
        assert_tensors_close({"out": out}, {"out": net.eval()(_tasks(0)[rank][0])},
                             f"rank {rank}")


def _mixed() -> str:
    net = _net()
    model, _ = metadist.strategy("ddp", sync_batchnorm=True).setup(
        net, torch.optim.SGD(net.parameters(), lr=LR))
    xs = _tasks(0)[metadist.world().rank][0]
    model(xs)  # the global batch's statistics
    try:
        model.functional_forward(model.full_parameters(), xs)  # this rank's own task
    except RuntimeError as exc:
        return str(exc)
    return "ran"


def test_one_layer_updated_from_the_global_batch_and_a_task_stops() -> None:
    for message in run_on_ranks(_mixed, 2):
        assert "both from the global batch" in message and "sync_running_stats" in message


# ----- a cooperative inner problem's uneven slices ---------------------------------------------

def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _problem(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(10, 5, generator=g), torch.randn(10, 2, generator=g),
            torch.randn(7, 5, generator=g), torch.randn(7, 2, generator=g))


def _cooperative_on_rank(strategy: str, idiom: str) -> dict[str, torch.Tensor] | str:
    net = _mlp()
    options = {"min_unit_params": 20} if strategy == "zero3" else {}
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    try:
        for step in range(STEPS):
            opt.zero_grad()
            fast = model.fast_weights()
            if idiom == "chunk":  # the README's idiom before: 4, 4, 2 samples on 3 ranks
                xs, ys, xq, yq = (t.chunk(fast.group_size)[fast.group_rank]
                                  for t in _problem(step))
            else:
                xs, ys, xq, yq = fast.split(*_problem(step))
            share = None if idiom != "wrong share" else 1 / 3
            for _ in range(2):
                fast = fast - 0.3 * fast.grad(F.mse_loss(model.functional_forward(fast, xs),
                                                         ys), share=share)
            s.backward(F.mse_loss(model.functional_forward(fast, xq), yq))
            opt.step()
    except ValueError as exc:
        return str(exc)
    return _state(model)


@pytest.mark.parametrize(("strategy", "idiom"), [("ddp", "split"), ("ddp", "chunk"),
                                                 ("zero3", "split")])
def test_uneven_cooperative_slices_weigh_each_sample_as_one_process(strategy: str,
                                                                     idiom: str) -> None:
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys, xq, yq = _problem(step)
        fast = dict(net.named_parameters())
        for _ in range(2):
            grads = torch.autograd.grad(F.mse_loss(functional_call(net, fast, (xs,)), ys),
                                        list(fast.values()), create_graph=True)
            fast = {n: p - 0.3 * g for (n, p), g in zip(fast.items(), grads, strict=True)}
        F.mse_loss(functional_call(net, fast, (xq,)), yq).backward()
        opt.step()
    want = copy.deepcopy(_state(net))
    for rank, state in enumerate(run_on_ranks(_cooperative_on_rank, 3, args=(strategy, idiom))):
        assert not isinstance(state, str), state
        assert_tensors_close(state, want, f"{strategy} {idiom} rank {rank}")


def test_a_share_that_is_not_the_slices_stops() -> None:
    messages = run_on_ranks(_cooperative_on_rank, 3, args=("ddp", "wrong share"))
    assert all(isinstance(m, str) and "leave share= out" in m for m in messages), messages
