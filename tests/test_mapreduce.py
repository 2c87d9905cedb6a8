"""metadist.mapreduce: both engines against single-process MAML, the spmd engine's gradients
to second order, results of every kind, failures on one rank, and the rpc engine."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

import metadist
import metadist.mapreduce as todist
from metadist.meta import MetaSGD, module_clone
from metadist.testing import is_loopback_address, listening_addresses, run_on_ranks

TASKS, K, INNER_STEPS, INNER_LR, META_STEPS = 5, 5, 2, 0.05, 3
TOL: dict[str, Any] = {"rtol": 1.3e-6, "atol": 1e-5}
per_task = todist.dim_partitioner(0, exclusive=True, keepdim=False)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(),
                         nn.Linear(20, 1))


def _tasks(step: int, count: int = TASKS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    amp = 0.1 + 4.9 * torch.rand(count, 1, 1, generator=g)
    phase = 3.0 * torch.rand(count, 1, 1, generator=g)
    x = torch.rand(count, 2 * K, 1, generator=g) * 10 - 5
    return x, amp * torch.sin(x + phase)


@todist.parallelize(partitioner=per_task, reducer=todist.mean_reducer)
def adapt(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Second-order MAML on one task: adapt a differentiable copy, return the query loss."""
    learner = module_clone(net, by="copy")
    inner = MetaSGD(learner, lr=INNER_LR)
    for _ in range(INNER_STEPS):
        inner.step(nn.functional.mse_loss(learner(x[:K]), y[:K]))
    return nn.functional.mse_loss(learner(x[K:]), y[K:])


def _meta_step(net: nn.Module) -> None:
    # Plain SGD by hand: any torch.optim optimiser imports torch._dynamo on first use, which
    # costs seconds per process on this machine.
    with torch.no_grad():
        for p in net.parameters():
            assert p.grad is not None
            p.sub_(0.1 * p.grad)
            p.grad = None


def _maml_reference() -> list[torch.Tensor]:
    net = _net()
    for step in range(META_STEPS):
        x, y = _tasks(step)
        torch.stack([adapt.__wrapped__(net, x[i], y[i]) for i in range(TASKS)]).mean().backward()
        _meta_step(net)
    return [p.detach() for p in net.parameters()]


def _maml(engine: str) -> list[torch.Tensor] | None:
    """The same training loop on ``engine``; rank 0's parameters (every rank's under spmd)."""
    todist.init(engine)
    try:
        if not todist.is_driver():
            return None
        net = _net()
        for step in range(META_STEPS):
            x, y = _tasks(step)
            with todist.autograd.context() as ctx:
                todist.autograd.backward(ctx, adapt(net, x, y))
            _meta_step(net)
        return [p.detach() for p in net.parameters()]
    finally:
        todist.shutdown()


@pytest.mark.parametrize("world_size", [2, 3])
def test_spmd_maml_equals_single_process(world_size: int) -> None:
    expected = _maml_reference()
    for got in run_on_ranks(_maml, world_size, args=("spmd",)):
        for p, q in zip(got, expected, strict=True):
            torch.testing.assert_close(p, q, **TOL)


def _lse(results: list[torch.Tensor]) -> torch.Tensor:
    return torch.logsumexp(torch.cat(results), dim=0)


@todist.parallelize(partitioner=per_task, reducer=_lse)
def features(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(net(x)).reshape(-1)


def _second_order(count: int, distributed: bool) -> list[torch.Tensor]:
    """Gradient of a penalty on the gradient of a nonlinear reduction of the parts."""
    net = _net()
    x = _tasks(0, count)[0]
    params = list(net.parameters())
    if distributed:
        todist.init("spmd")
        loss = features(net, x)
    else:
        loss = _lse([features.__wrapped__(net, x[i]) for i in range(count)])
    grads = torch.autograd.grad(loss, params, create_graph=True)
    sum(g.pow(2).sum() for g in grads).backward()
    if distributed:
        todist.shutdown()
    return [p.grad for p in params if p.grad is not None]


@pytest.mark.parametrize(("world_size", "count"), [(2, 3), (3, 2)])
def test_spmd_second_order_through_the_reduction(world_size: int, count: int) -> None:
    # (3, 2): rank 2 computes no part, yet takes part in every backward collective.
    expected = _second_order(count, distributed=False)
    for got in run_on_ranks(_second_order, world_size, args=(count, True)):
        assert len(got) == len(expected)
        for p, q in zip(got, expected, strict=True):
            torch.testing.assert_close(p, q, **TOL)


def mixed(net: nn.Module, x: torch.Tensor, index: torch.Tensor) -> dict[str, Any]:
    """Results of every kind: a loss, a tensor too large for the byte exchange, one whose
    shape depends on the part, an integer tensor and a plain float."""
    out = net(x)
    n = int(index) + 1
    return {"loss": out.pow(2).mean(), "big": out.reshape(-1).repeat(1000),
            "ragged": out.reshape(-1)[:n] * 2, "count": torch.arange(n), "acc": float(n) / 4}


def _mixed(distributed: bool) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    net = _net()
    x, index = _tasks(1, 4)[0], torch.arange(4)
    if distributed:
        todist.init("spmd")
        results = todist.remote_sync_call(mixed, args=(net, x, index), partitioner=per_task)
        todist.shutdown()
    else:
        results = [mixed(net, x[i], index[i]) for i in range(4)]
    objective = sum(r["loss"] + 1e-3 * r["big"].sum() + r["ragged"].sum() for r in results)
    objective.backward()
    values = [{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in r.items()}
              for r in results]
    return values, [p.grad for p in net.parameters() if p.grad is not None]


def test_spmd_results_of_every_kind() -> None:
    expected_values, expected_grads = _mixed(distributed=False)
    ranks = run_on_ranks(_mixed, 3, args=(True,))
    for values, grads in ranks:
        for got, want, on_rank0 in zip(values, expected_values, ranks[0][0], strict=True):
            assert got.keys() == want.keys() and got["acc"] == want["acc"]
            assert got["count"].dtype == torch.int64
            for key in ("loss", "big", "ragged", "count"):
                torch.testing.assert_close(got[key], want[key], **TOL)
                assert torch.equal(got[key], on_rank0[key])  # every rank: the owner's bits
        for p, q in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(p, q, **TOL)


def fails_on_task_one(x: torch.Tensor) -> torch.Tensor:
    if float(x.reshape(-1)[0]) == 1.0:
        raise ValueError("task one is broken")
    return x.sum()


def _failure_and_mismatch() -> tuple[str, str]:
    todist.init("spmd")
    try:
        with pytest.raises(todist.PartFailedError) as failed:
            todist.remote_sync_call(fails_on_task_one, args=(torch.arange(4.0),),
                                    partitioner=todist.exclusive_batch_partitioner)
        rank = metadist.world().rank
        with pytest.raises(ValueError, match="split the call") as mismatch:
            todist.remote_sync_call(torch.sum, args=(torch.zeros(2 + rank),))
        return str(failed.value), str(mismatch.value)
    finally:
        todist.shutdown()


def test_spmd_failure_on_one_rank_fails_every_rank() -> None:
    for failed, mismatch in run_on_ranks(_failure_and_mismatch, 2):
        assert "part 1 of fails_on_task_one failed on rank 1 with ValueError" in failed
        assert "task one is broken" in failed
        assert "rank 0: parts on workers [0, 1]" in mismatch
        assert "rank 1: parts on workers [0, 1]" in mismatch


def _exchange_rounds() -> list[list[bytes]]:
    from metadist.mapreduce.exchange import exchange

    rank = metadist.world().rank
    sizes = [(3, 0, 5), (0, 5000, 1), (70, 2, 4000)]  # empty, overflow, fits the grown room
    return [exchange(bytes([rank + 1]) * row[rank]) for row in sizes]


def test_byte_exchange_grows_its_room_on_every_rank_alike() -> None:
    expected = [[bytes([r + 1]) * row[r] for r in range(3)]
                for row in [(3, 0, 5), (0, 5000, 1), (70, 2, 4000)]]
    assert run_on_ranks(_exchange_rounds, 3) == [expected] * 3


def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def fail_remotely() -> None:
    raise KeyError("remote failure")


def _rpc_session() -> dict[str, Any] | None:
    params = _maml("rpc")
    todist.init("rpc")
    try:
        if not todist.is_driver():
            return None
        x = torch.arange(4.0, requires_grad=True)
        squares = todist.remote_async_call(square, args=(x,), partitioner="worker1").wait()
        with todist.autograd.context() as ctx:
            total = todist.remote_sync_call(square, args=(x,), reducer=todist.sum_reducer)
            (grad,) = todist.autograd.grad(ctx, total.sum(), x)
        with pytest.raises(Exception, match="remote failure"):
            todist.remote_sync_call(fail_remotely, partitioner=1)
        return {"params": params, "squares": squares, "grad": grad}
    finally:
        todist.shutdown()


def test_rpc_engine_equals_single_process() -> None:
    # The ranks of the shared pool start and stop RPC inside the body (twice); the pool then
    # serves the next test as before.
    result = run_on_ranks(_rpc_session, 2)[0]
    for p, q in zip(result["params"], _maml_reference(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
    assert result["squares"][0].tolist() == [0.0, 1.0, 4.0, 9.0]
    assert result["grad"].tolist() == [0.0, 2.0, 4.0, 6.0]


def _rpc_listeners() -> list[str]:
    todist.init("rpc")
    try:
        todist.barrier()  # every rank's RPC agent is up
        return listening_addresses()
    finally:
        todist.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rpc_engine_listens_on_loopback_only() -> None:
    # torch's tcp:// rendezvous would add a store on every interface of rank 0; fresh
    # processes, as pooled ones may hold other tests' listeners.
    for rank, addresses in enumerate(metadist.launch(_rpc_listeners, 2, timeout=120,
                                                     threads=1)):
        assert addresses, f"rank {rank} should listen for RPC"
        assert all(map(is_loopback_address, addresses)), f"rank {rank} listens on {addresses}"


def test_rpc_pins_its_interfaces_to_loopback_on_one_machine_only() -> None:
    # TensorPipe listens where the host name resolves (loopback on some machines only).
    from metadist.mapreduce import rpc
    from metadist.runtime.rendezvous import loopback_interface

    lo = loopback_interface()
    assert lo is not None
    assert rpc.loopback_pins("127.0.0.1", {}) == {"TP_SOCKET_IFNAME": lo,
                                                  "GLOO_SOCKET_IFNAME": lo}
    assert rpc.loopback_pins("localhost", {"TP_SOCKET_IFNAME": "eth1"}) == {
        "GLOO_SOCKET_IFNAME": lo}  # the user's choice stands
    assert rpc.loopback_pins("10.0.0.1", {}) == {}  # several nodes: their real interface


def _auto_init() -> tuple[str, str, int]:
    seen: list[str] = []

    @todist.auto_init_rpc(lambda: seen.append(todist.get_world_info().worker_name))
    def main() -> tuple[str, int]:
        return todist.engine(), todist.get_worker_id("worker1")

    engine, worker = main()
    return seen[0], engine, worker


def test_auto_init_runs_worker_init_and_names_workers() -> None:
    assert run_on_ranks(_auto_init, 2) == [("worker0", "spmd", 1), ("worker1", "spmd", 1)]


def test_unknown_engine_lists_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="engine='mpi' is not known; choose one of: spmd, rpc"):
        todist.init("mpi")
    monkeypatch.setenv(todist.ENGINE_ENV, "threads")
    with pytest.raises(ValueError, match="METADIST_MAPREDUCE_ENGINE='threads' is not known"):
        todist.engine()


def outer(x: torch.Tensor) -> torch.Tensor:
    # A call made inside a part runs all its parts where it is.
    inner: torch.Tensor = todist.remote_sync_call(square, args=(x,), reducer=todist.sum_reducer)
    return inner


def test_one_process_runs_every_part_locally_with_the_same_api() -> None:
    todist.init()
    try:
        net = _net()
        x, y = _tasks(0)
        with todist.autograd.context() as ctx:
            todist.autograd.backward(ctx, adapt(net, x, y), inputs=list(net.parameters()))
        reference = _net()
        torch.stack([adapt.__wrapped__(reference, x[i], y[i]) for i in range(TASKS)]).mean(
            ).backward()
        for p, q in zip(net.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL)
        v = torch.arange(3.0, requires_grad=True)
        total = todist.remote_sync_call(outer, args=(v,), partitioner=0)[0]
        assert todist.autograd.grad(ctx, total.sum(), v)[0].tolist() == [0.0, 2.0, 4.0]
        with pytest.raises(metadist.MetadistError, match="only the rpc engine has"):
            todist.autograd.get_gradients(ctx)
    finally:
        todist.shutdown()
    assert not metadist.is_initialized()
