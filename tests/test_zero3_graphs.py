"""zero3/hsdp graphs read after their unshard's backward, or with forwards in between: a
second backward through a graph kept with ``retain_graph=True``, a ``create_graph=True``
backward whose recorded graph runs after more forwards, ``full_parameters()`` graphs (MAML,
ANIL through ``functional_forward``) with forwards in between. Each trains like one process,
and frees what it gathered when done."""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef

import metadist
from metadist.comm import stats
from metadist.strategies.zero3.strategy import ShardedModule
from metadist.testing import run_on_ranks, unique_storage_bytes
from parity import assert_tensors_close

STEPS, BATCH, LAM = 10, 12, 0.1
Backward = Callable[..., None]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 2))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g))
            for _ in range(STEPS)]


def _mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b) ** 2).mean()


class Api:
    """What a step needs, the same for a plain module and a metadist one."""

    def __init__(self, model: nn.Module, params: Callable[[], dict[str, torch.Tensor]],
                 call: Callable[..., torch.Tensor], backward: Backward, shards: int) -> None:
        self.model, self.params, self.call = model, params, call
        self.backward, self.shards = backward, shards  # ranks a parameter is sharded over


def _retain(api: Api, x: torch.Tensor, y: torch.Tensor) -> None:
    """Two losses on one forward, backpropagated one after the other."""
    out = api.model(x)
    api.backward(_mse(out, y), retain_graph=True)
    api.backward(out.square().mean())


def _input_penalty(api: Api, x: torch.Tensor, y: torch.Tensor) -> None:
    """A penalty on the input gradient (create_graph), with an evaluation forward and a second
    training forward between recording its graph and backpropagating it."""
    x = x.clone().requires_grad_(True)
    out = api.model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with torch.no_grad():
        api.model(x)
    out2 = api.model(0.5 * x)
    api.backward(_mse(out, y) + _mse(out2, y) + (gx**2).sum(1).mean())


def _maml(api: Api, x: torch.Tensor, y: torch.Tensor) -> None:
    """One second-order MAML step on full_parameters(), with an evaluation forward before the
    outer backward."""
    params = api.params()
    half = x.shape[0] // 2
    inner = _mse(api.call(params, x[:half]), y[:half])
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {k: p - 0.1 * g for (k, p), g in zip(params.items(), grads, strict=True)}
    with torch.no_grad():
        api.model(x)
    api.backward(_mse(api.call(fast, x[half:]), y[half:]))


def _anil(api: Api, x: torch.Tensor, y: torch.Tensor) -> None:
    """Only the head adapts: functional_forward fills in the body's parameters itself."""
    head = {k: v for k, v in api.params().items() if k.startswith("4.")}
    half = x.shape[0] // 2
    for _ in range(2):
        inner = _mse(api.call(head, x[:half]), y[:half])
        grads = torch.autograd.grad(inner, list(head.values()), create_graph=True)
        head = {k: p - 0.1 * g for (k, p), g in zip(head.items(), grads, strict=True)}
        api.model(x).sum()  # a training forward whose graph is dropped
    api.backward(_mse(api.call(head, x[half:]), y[half:]))


LOCAL = {"retain": _retain, "input_penalty": _input_penalty, "maml": _maml, "anil": _anil}


def _reference(name: str, ranks: int) -> dict[str, torch.Tensor]:
    """One process: each rank's slice as a task of its own, losses averaged over the ranks
    (every objective here is a mean over its slice, so this is the global objective); the
    parameter-gradient penalty on the global loss."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    api = Api(net, lambda: dict(net.named_parameters()),
              lambda p, x: functional_call(net, p, (x,), strict=False),
              lambda loss, **kw: (loss / ranks).backward(**kw), 1)
    for x, y in _data():
        opt.zero_grad()
        if name == "grad_penalty":
            loss = _mse(net(x), y)
            grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
            (_mse(net(0.5 * x), y) + loss + LAM * sum((g**2).sum() for g in grads)).backward()
        else:
            for xs, ys in zip(x.chunk(ranks), y.chunk(ranks), strict=True):
                LOCAL[name](api, xs, ys)
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _grad_penalty(api: Api, x: torch.Tensor, y: torch.Tensor) -> None:
    """A penalty on the parameters' gradient: autograd.grad through the units with
    create_graph=True, forwards in between, then one backward of everything. Each rank's
    gradient shard is its slice of the global gradient: the penalties of one shard group add
    up to the global penalty, and the mean over all N ranks divides it by N / replicas."""
    loss = _mse(api.model(x), y)
    # zero3 asks for the reduced slice on purpose (without it, autograd.grad raises)
    with getattr(api.model, "reduced_shard_grads", nullcontext)():
        grads = torch.autograd.grad(loss, list(api.model.parameters()), create_graph=True)
    with torch.no_grad():
        api.model(x)
    out2 = api.model(0.5 * x)
    api.backward(_mse(out2, y) + loss + LAM * api.shards * sum((g**2).sum() for g in grads))


LOCAL["grad_penalty"] = _grad_penalty


def _gathered(model: ShardedModule) -> int:
    return unique_storage_bytes(flat.full for flat in model.flats)


def _on_rank(name: str, strategy: str, shards: int
             ) -> tuple[dict[str, torch.Tensor], list[int], int]:
    w = metadist.world()
    s = metadist.strategy(strategy, min_unit_params=20)
    net = _net()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, ShardedModule)
    api = Api(model, model.full_parameters, model.functional_forward,
              s.backward, shards)
    left = []
    for x, y in _data():
        opt.zero_grad()
        LOCAL[name](api, x.chunk(w.world_size)[w.rank], y.chunk(w.world_size)[w.rank])
        opt.step()
        left.append(_gathered(model))  # after the step: nothing but the root unit
    root = unique_storage_bytes(flat.full for flat in model.units[-1].flats)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, left, root


CASES = [("zero3", 2, 1), ("zero3", 3, 1), ("hsdp", 4, 2)]


@pytest.mark.parametrize("name", list(LOCAL))
@pytest.mark.parametrize(("strategy", "n", "nnodes"), CASES)
def test_graphs_read_again_train_like_one_process(name: str, strategy: str, n: int,
                                                  nnodes: int) -> None:
    want = _reference(name, n)
    for rank, (state, left, root) in enumerate(
            run_on_ranks(_on_rank, n, nnodes=nnodes, args=(name, strategy, n // nnodes))):
        assert_tensors_close(state, want, f"{name} {strategy} n={n} rank={rank}")
        assert left == [root] * STEPS, (left, root)


def _retain_memory() -> tuple[list[int], int]:
    """Gathered bytes after each of two backwards through a retained graph, and a unit."""
    s = metadist.strategy("zero3", min_unit_params=20)
    net = _net()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, ShardedModule)
    x = torch.randn(4, 6)
    out = model(x)
    seen = []
    for retain in (True, False):
        out.square().mean().backward(retain_graph=retain)
        seen.append(_gathered(model))
    opt.step()
    return seen, unique_storage_bytes(flat.full for flat in model.units[-1].flats)


def test_a_retained_graph_frees_what_its_second_backward_gathered() -> None:
    for seen, root in run_on_ranks(_retain_memory, 2):
        assert seen == [root, root]


def _copies_per_step() -> list[tuple[int, bool, bool]]:
    """Per step: all-gathers made by four full_parameters() calls (two with grad, two
    without) beyond one per flat not gathered, whether they all share one copy, whether it
    outlived the calls until the step, and whether the step freed it."""
    s = metadist.strategy("zero3", min_unit_params=20)
    net = _net()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, ShardedModule)
    seen = []
    for x, y in _data()[:2]:
        apart = sum(not flat.gathered for flat in model.flats)  # the root unit stays gathered
        with stats.counting() as counted:
            calls = [model.full_parameters() for _ in range(2)]
            with torch.no_grad():
                calls += [model.full_parameters() for _ in range(2)]
        shared = all(c[k].untyped_storage().data_ptr() == calls[0][k].untyped_storage().data_ptr()
                     for c in calls for k in c)
        s.backward(_mse(model.functional_forward(calls[0], x), y))
        copies = [StorageWeakRef(t.untyped_storage()) for t in calls[0].values()]
        del calls
        gc.collect()
        kept = not any(ref.expired() for ref in copies)
        opt.step()
        gc.collect()
        seen.append((counted.ops["all_gather"].calls - apart, shared and kept,
                     all(ref.expired() for ref in copies)))
    return seen


def test_full_parameters_gathers_once_per_step_and_the_step_drops_the_copy() -> None:
    for seen in run_on_ranks(_copies_per_step, 2):
        assert seen == [(0, True, True)] * 2, seen
