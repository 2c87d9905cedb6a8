"""A BatchNorm on several ranks normalises by the statistics the program says, or stops
(strategies/batchnorm/statistics.py). Before, a plain BatchNorm under a data-parallel strategy
normalised each rank's slice of the global batch by the slice's own statistics and trained
to other values than one process, silently (the default was ``sync_batchnorm=False``).

* left unsaid, the first training forward on 2, 3 and 2 x 2 ranks raises, naming the layer
  and both choices (before: it ran and differed from one process);
* ``sync_batchnorm=False`` normalises each rank's slice alone, as asked: the result of one
  process averaging the slices' losses, each slice normalised by itself;
* ``sync_batchnorm=True`` is one process's result on the global batch, a ragged last batch
  split unevenly over the ranks (stand-in samples included) too;
* no check where batch statistics are not used (evaluation), nor on a per-rank-task forward
  on whole parameters or on a copy of the model (``module_clone``), whose batch is the
  rank's own task: there per-rank statistics are one process's (that process runs each
  task's batch alone).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import metadist
import parity
from metadist.meta import module_clone
from metadist.strategies.batchnorm import statistics as batch_statistics
from metadist.testing import run_on_ranks

STEPS = 10
UNITS = {"wrap_classes": (nn.Linear,)}


def _train(strategy: str, options: dict[str, Any]) -> dict[str, torch.Tensor] | str:
    """STEPS steps of SGD on this rank's slices; the error's message where one is raised."""
    s = metadist.strategy(strategy, **options)
    net = parity.make_net()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    w = metadist.world()
    try:
        for x, y in parity.batches(STEPS):
            opt.zero_grad()
            xs, ys = (parity.shard(t, w.rank, w.world_size) for t in (x, y))
            s.backward(parity.loss_fn(model(xs), ys))
            opt.step()
    except RuntimeError as e:
        return str(e)
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


def _one_process(slices: int) -> dict[str, torch.Tensor]:
    """One process on the global batch, BatchNorm normalising each of ``slices`` equal
    slices by itself (1: the global batch's statistics)."""
    net = parity.make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in parity.batches(STEPS):
        opt.zero_grad()
        losses = [parity.loss_fn(net(parity.shard(x, r, slices)), parity.shard(y, r, slices))
                  for r in range(slices)]
        (sum(losses) / slices).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize(("strategy", "n", "nnodes", "options"), [
    ("ddp", 2, 1, {}), ("zero3", 3, 1, UNITS), ("hsdp", 4, 2, UNITS)])
def test_unsaid_batch_statistics_on_several_ranks_raise(strategy: str, n: int, nnodes: int,
                                                        options: dict[str, Any]) -> None:
    for message in run_on_ranks(_train, n, nnodes=nnodes, timeout=300,
                                args=(strategy, options)):
        assert isinstance(message, str), "trained with per-rank statistics, unasked"
        assert "'norm'" in message and "sync_batchnorm=True" in message \
            and "sync_batchnorm=False" in message, message


@pytest.mark.parametrize(("said", "strategy", "n", "options"), [
    (False, "ddp", 2, {}), (False, "zero3", 3, UNITS), (True, "ddp", 2, {}),
    (True, "zero3", 3, UNITS)])
def test_said_batch_statistics_are_the_ones_used(said: bool, strategy: str, n: int,
                                                 options: dict[str, Any]) -> None:
    want = _one_process(1 if said else n)
    out = run_on_ranks(_train, n, timeout=300,
                       args=(strategy, {**options, "sync_batchnorm": said}))
    for rank, got in enumerate(out):
        assert not isinstance(got, str), got
        parity.assert_tensors_close(got, want, f"{strategy} n={n} said={said} rank={rank}")


def _unchecked_forwards(strategy: str, options: dict[str, Any]) -> list[torch.Tensor]:
    """An evaluation forward on this rank's slice, and a per-rank-task forward on whole
    parameters (this rank's own task), with the choice unsaid."""
    s = metadist.strategy(strategy, **options)
    net = parity.make_net()
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = parity.batches(1)[0][0]
    w = metadist.world()
    mine = parity.shard(x, w.rank, w.world_size)
    model.eval()
    evaluated = model(mine).detach()
    model.train()
    params = model.full_parameters()
    task = model.functional_forward(params, mine)
    torch.autograd.grad(task.square().mean(), list(params.values()), allow_unused=True)
    cloned = module_clone(model, by="copy")(mine)  # a copy each rank adapts on its task
    return [evaluated, task.detach(), cloned.detach()]


@pytest.mark.parametrize(("strategy", "options"), [("ddp", {}), ("zero3", UNITS)])
def test_evaluation_and_per_rank_tasks_are_not_checked(strategy: str,
                                                       options: dict[str, Any]) -> None:
    out = run_on_ranks(_unchecked_forwards, 2, timeout=300, args=(strategy, options))
    x = parity.batches(1)[0][0]
    for rank, (evaluated, task, cloned) in enumerate(out):
        net, mine = parity.make_net(), parity.shard(x, rank, 2)
        with torch.no_grad():
            want_eval = net.eval()(mine)  # running statistics as set up
            want_task = net.train()(mine)  # a task's batch normalised alone, as one process
            want_clone = net(mine)  # after the task's forward updated the running statistics
        torch.testing.assert_close(evaluated, want_eval, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(task, want_task, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(cloned, want_clone, rtol=1.3e-6, atol=1e-5)


def test_dp_replicas_are_asked_and_cannot_synchronise() -> None:
    """'dp' splits a batch over GPU replicas in one process: a plain BatchNorm there is
    asked for the choice like ranks are (checked here on the CPU through the hook 'dp'
    installs for its replicas), and sync_batchnorm=True, which threads cannot honour, is
    refused at setup (before: accepted and ignored, each replica normalising its chunk)."""
    net = parity.make_net()
    batch_statistics.ask_for_the_choice(net, None, "dp", 2)
    x = parity.batches(1)[0][0]
    with pytest.raises(RuntimeError, match=r"2 replicas under 'dp'.*strategy\('ddp', "
                                           r"sync_batchnorm=True\).*sync_batchnorm=False"):
        net(x)
    # dp runs torch's replicas of the layer, made for each step (as replicate() makes them)
    replica = net.norm._replicate_for_data_parallel()
    with pytest.raises(RuntimeError, match=r"2 replicas under 'dp'"):
        replica(torch.randn(4, parity.HIDDEN))
    net.eval()(x)  # running statistics: nothing differs
    batch_statistics.ask_for_the_choice(net, False, "dp", 2)  # a setup that says it
    net.train()(x)
    with pytest.raises(ValueError, match=r"sync_batchnorm=True cannot be honoured.*'ddp'"):
        metadist.strategy("dp", sync_batchnorm=True).setup_module(parity.make_net())


EPOCHS, PER_RANK = 5, 2


def _ragged_data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(samples, parity.FEATURES, generator=g), \
        torch.randn(samples, parity.OUT, generator=g)


def _train_ragged(strategy: str, options: dict[str, Any], samples: int
                  ) -> dict[str, torch.Tensor]:
    """EPOCHS epochs through a distributed loader whose last global batch is ragged."""
    from torch.utils.data import DataLoader, TensorDataset

    s = metadist.strategy(strategy, sync_batchnorm=True, **options)
    net = parity.make_net()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = s.setup_dataloader(DataLoader(TensorDataset(*_ragged_data(samples)),
                                           batch_size=PER_RANK))
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad()
            s.backward(parity.loss_fn(model(x), y))
            opt.step()
    full = model.full_parameters()
    return {**{n: p.detach().clone() for n, p in full.items()},
            **{n: b.clone() for n, b in model.module.named_buffers()}}


@pytest.mark.parametrize(("strategy", "n", "nnodes", "samples", "options"), [
    ("ddp", 4, 1, 10, {}),  # last global batch 2: split 1, 1, 0, 0 (two stand-ins)
    ("zero3", 3, 1, 10, UNITS),  # last global batch 4: split 2, 1, 1
    ("hsdp", 4, 2, 14, UNITS)])  # last global batch 6: split 2, 2, 1, 1
def test_synchronised_statistics_are_exact_on_a_ragged_last_batch(
        strategy: str, n: int, nnodes: int, samples: int, options: dict[str, Any]) -> None:
    """sync_batchnorm=True on a loader whose last global batch is split unevenly, with
    stand-in samples where a rank is left without any: one process's parameters and running
    statistics after 10 steps. Before, a rank's loss sent its gradient through the global
    statistics unweighted by its share, and a stand-in's sample counted in them: 0.45,
    0.044 and 0.028 apart in these three cases."""
    x, y = _ragged_data(samples)
    net = parity.make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    per_step = n * PER_RANK
    for _ in range(EPOCHS):
        for lo in range(0, samples, per_step):
            opt.zero_grad()
            parity.loss_fn(net(x[lo:lo + per_step]), y[lo:lo + per_step]).backward()
            opt.step()
    want = {**{k: p.detach() for k, p in net.named_parameters()}, **dict(net.named_buffers())}
    for rank, got in enumerate(run_on_ranks(_train_ragged, n, nnodes=nnodes, timeout=300,
                                            args=(strategy, options, samples))):
        parity.assert_tensors_close(got, want, f"{strategy} n={n} rank={rank}")
