"""Batch statistics reached around the BatchNorm layers' hooks are decided at F.batch_norm.

Reproduction: a set-up model asks whether its BatchNorm layers normalise by the global
batch or each rank's (``sync_batchnorm``) through hooks on the layers. A layer's ``forward``
called directly, or a normalisation of the program's own through ``F.batch_norm`` (as
functional MAML learners write it), went around them: at 2 ranks, 5 steps trained 5.2e-2 away
from one process on the global batch under ddp, zero2 and zero3, silently, with
``sync_batchnorm`` unsaid and also with ``sync_batchnorm=True``. Now every such call is
decided where it computes (strategies/batchnorm/calls.py): unsaid it stops and asks, with
``True`` it uses the global batch's statistics, with ``False`` each rank's, as the layers do.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

STEPS, GLOBAL_BATCH, C = 10, 24, 6
CELLS = [("ddp", 2, 1), ("zero2", 3, 1), ("zero3", 3, 1), ("hsdp", 4, 2)]


class RawBatchNorm(nn.Module):
    """A normalisation of the program's own, as nn.BatchNorm1d computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(C)), nn.Parameter(torch.zeros(C))
        self.register_buffer("mean", torch.zeros(C))
        self.register_buffer("var", torch.ones(C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, self.weight, self.bias,
                            training=self.training, momentum=0.1, eps=1e-5)


class DirectCall(nn.Module):
    """A BatchNorm layer run through its forward method, not as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn.forward(x)


def _net(kind: str) -> nn.Module:
    if kind == "method":
        return WithMethod()
    torch.manual_seed(0)
    norm = {"own": RawBatchNorm, "direct": DirectCall, "layer": lambda: nn.BatchNorm1d(C)}[kind]
    return nn.Sequential(nn.Linear(4, C), norm(), nn.Tanh(), nn.Linear(C, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def _values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters and running statistics (not the step count)."""
    return {k: t.detach().clone() for k, t in state.items() if t.is_floating_point()}


def _train(kind: str, strategy: str, said: bool | None) -> dict[str, Any]:
    net = _net(kind)
    plain = copy.deepcopy(net)
    # zero3's default units: a layer's forward called directly runs inside its unit's
    s = metadist.strategy(strategy, sync_batchnorm=said)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    w = metadist.world()
    mine = slice(w.rank * GLOBAL_BATCH // w.world_size,
                 (w.rank + 1) * GLOBAL_BATCH // w.world_size)
    call = "score" if kind == "method" else "__call__"  # the program's way in
    try:
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            F.mse_loss(getattr(model, call)(x[mine]), y[mine]).backward()
            opt.step()
            popt.zero_grad()
            F.mse_loss(getattr(plain, call)(x), y).backward()
            popt.step()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"got": _values(model.state_dict()), "want": _values(plain.state_dict())}


@pytest.mark.parametrize("kind", ["own", "direct"])
@pytest.mark.parametrize(("strategy", "n", "nodes"), CELLS)
def test_unsaid_stops_and_asks(kind: str, strategy: str, n: int, nodes: int) -> None:
    """It trained 5.2e-2 away from one process before, silently."""
    for out in run_on_ranks(_train, n, args=(kind, strategy, None), nnodes=nodes):
        assert out.get("error", "").startswith("F.batch_norm (a BatchNorm reached by a call "
                                               "of its forward, or a normalisation of your "
                                               "own) would normalise by batch statistics"), out
        assert "sync_batchnorm=True" in out["error"]


@pytest.mark.parametrize("kind", ["own", "direct"])
@pytest.mark.parametrize(("strategy", "n", "nodes"), CELLS)
def test_sync_batchnorm_true_is_one_process(kind: str, strategy: str, n: int,
                                            nodes: int) -> None:
    """Parameters and running statistics: the global batch's (5.2e-2 away before, for the
    program's own normalisation)."""
    for rank, out in enumerate(run_on_ranks(_train, n, args=(kind, strategy, True),
                                            nnodes=nodes)):
        assert "error" not in out, out.get("error")
        assert_tensors_close(out["got"], out["want"], where=f"{strategy} rank {rank} {kind}")


@pytest.mark.parametrize("kind", ["own", "direct"])
def test_sync_batchnorm_false_is_each_ranks_batch_as_for_layers(kind: str) -> None:
    """Each rank's batch alone, as the layers called as modules compute it."""
    outs = run_on_ranks(_train, 3, args=(kind, "zero2", False))
    layers = run_on_ranks(_train, 3, args=("layer", "zero2", False))
    for rank, (out, layer) in enumerate(zip(outs, layers, strict=True)):
        assert "error" not in out, out.get("error")
        assert_tensors_close(dict(enumerate(out["got"].values())),  # by position: the
                             dict(enumerate(layer["got"].values())),  # buffers' names differ
                             where=f"rank {rank} {kind}")


def _per_task(said: bool | None) -> list[torch.Tensor]:
    """A per-rank-task forward (explicit parameters): each rank's batch is its own task."""
    net = _net("own")
    plain = copy.deepcopy(net)
    model, _ = metadist.strategy("ddp", sync_batchnorm=said).setup(
        net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = _batch(metadist.world().rank)[0][:8]
    out = model.functional_forward(model.full_parameters(), x)
    return [out.detach(), plain(x).detach()]


def test_a_per_rank_task_normalises_its_own_batch() -> None:
    for got, want in run_on_ranks(_per_task, 2, args=(None,)):
        assert_tensors_close({"out": got}, {"out": want}, where="per-rank task")


def _cooperative(said: bool | None) -> dict[str, Any]:
    """One second-order inner step on fast weights (zero3: the ranks share the problem)."""
    net = _net("own")
    plain = copy.deepcopy(net)
    s = metadist.strategy("zero3", sync_batchnorm=said)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch(0)
    w = metadist.world()
    mine = slice(w.rank * GLOBAL_BATCH // w.world_size,
                 (w.rank + 1) * GLOBAL_BATCH // w.world_size)
    try:
        fast = model.fast_weights()
        fast = fast - 0.1 * fast.grad(F.mse_loss(model.functional_forward(fast, x[mine]),
                                                 y[mine]))
        s.backward(F.mse_loss(model.functional_forward(fast, x[mine]), y[mine]))
        opt.step()
    except RuntimeError as exc:
        return {"error": str(exc)}
    params = dict(plain.named_parameters())
    grads = torch.autograd.grad(F.mse_loss(torch.func.functional_call(plain, params, (x,)), y),
                                list(params.values()), create_graph=True)
    fast_plain = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads, strict=True)}
    F.mse_loss(torch.func.functional_call(plain, fast_plain, (x,)), y).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    state = model.state_dict()
    return {"got": {n: state[n] for n, _ in plain.named_parameters()},
            "want": {n: p.detach() for n, p in plain.named_parameters()}}


def test_a_cooperative_inner_problem_uses_its_groups_batch() -> None:
    for rank, out in enumerate(run_on_ranks(_cooperative, 2, args=(True,))):
        assert "error" not in out, out.get("error")
        assert_tensors_close(out["got"], out["want"], where=f"cooperative rank {rank}")
    for out in run_on_ranks(_cooperative, 2, args=(None,)):
        assert out.get("error", "").startswith("F.batch_norm in a cooperative inner problem")


def _ragged(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64: the last global batch's BatchNorm over 2 samples amplifies float32
    rounding to 4.9e-4 in 10 steps (SyncBatchNorm layers alike), hiding any weighting."""
    g = torch.Generator().manual_seed(2)
    return (torch.randn(samples, 4, generator=g, dtype=torch.float64),
            torch.randn(samples, 2, generator=g, dtype=torch.float64))


def _train_ragged(samples: int) -> dict[str, torch.Tensor]:
    """5 epochs through a distributed loader whose last global batch is ragged."""
    s = metadist.strategy("ddp", sync_batchnorm=True)
    net = _net("own").double()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = s.setup_dataloader(DataLoader(TensorDataset(*_ragged(samples)), batch_size=2))
    for _ in range(5):
        for x, y in loader:
            opt.zero_grad()
            s.backward(F.mse_loss(model(x), y))
            opt.step()
    return _values(model.state_dict())


def test_the_programs_own_normalisation_is_exact_on_a_ragged_last_batch() -> None:
    """10 samples on 4 ranks of 2: the last global batch splits 1, 1, 0, 0 (two stand-in
    samples, weight 0): each rank's share weighs its statistics as SyncBatchNorm's do."""
    x, y = _ragged(10)
    net = _net("own").double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(5):
        for lo in range(0, 10, 8):
            opt.zero_grad()
            F.mse_loss(net(x[lo:lo + 8]), y[lo:lo + 8]).backward()
            opt.step()
    for rank, got in enumerate(run_on_ranks(_train_ragged, 4, args=(10,))):
        assert_tensors_close(got, _values(net.state_dict()), where=f"ragged rank {rank}")


class WithMethod(nn.Module):
    """A model whose program computes through a method, not its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net("own")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called here
        raise AssertionError("the program computes through score()")

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_computation_through_a_models_method_is_decided_too() -> None:
    """Outside the model's forward, the call is known by the model's tensors it is given."""
    for out in run_on_ranks(_train, 2, args=("method", "ddp", None)):
        assert out.get("error", "").startswith("F.batch_norm"), out
    for rank, out in enumerate(run_on_ranks(_train, 2, args=("method", "ddp", True))):
        assert "error" not in out, out.get("error")
        assert_tensors_close(out["got"], out["want"], where=f"method rank {rank}")
