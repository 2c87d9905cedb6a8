"""metadist.compat.torchopt.distributed: TorchOpt's distributed API and layout on metadist.

A TorchOpt-style MAML program (rank 0 drives, the other rank serves) under `metadist run`
with no engine setting, against one process and against plain PyTorch (the inner loop
written with torch.func, independent of the compat layer); then one test per place where
TorchOpt's semantics differ from metadist's own API.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metadist
import metadist.compat.torchopt.distributed as todist
from metadist import mapreduce
from metadist.compat.torchopt.distributed import api, autograd, world
from metadist.testing import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "torchopt_programs" / "maml_omniglot.py"
STEPS = 10
# The program is float64. Measured here: the parameters after 10 steps differ by at most
# 1.6e-15 (entries up to 1.12) between 2 workers, 1 worker and the plain-PyTorch reference,
# which differ only in the order the task losses are summed; the evaluation loss by 7e-16.
# 1e-12 leaves ~600x for another CPU's summation order in the float64 convolutions; a wrong
# inner step (a MetaSGD with 1.5x the learning rate) moves the parameters by 0.80.
TOL = {"rtol": 1e-12, "atol": 1e-12}

# torchopt 0.7.3: torchopt.distributed.__all__ and torchopt.distributed.autograd.__all__.
TORCHOPT_ALL = {
    "is_available", "TensorDimensionPartitioner", "dim_partitioner", "batch_partitioner",
    "mean_reducer", "sum_reducer", "remote_async_call", "remote_sync_call", "parallelize",
    "parallelize_async", "parallelize_sync", "get_world_info", "get_world_rank", "get_rank",
    "get_world_size", "get_local_rank", "get_local_world_size", "get_worker_id", "barrier",
    "auto_init_rpc", "on_rank", "not_on_rank", "rank_zero_only", "rank_non_zero_only",
}
TORCHOPT_AUTOGRAD_ALL = {"is_available", "context", "DistAutogradContext", "get_gradients",
                         "backward", "grad"}


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE",
                                                                      "MASTER_", "LOCAL_"))}
    env.pop(mapreduce.ENGINE_ENV, None)  # no engine setting: the layer's default must do
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False, cwd=ROOT)


def _program() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchopt_maml_program", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain_inner_loop(net: nn.Module, x_spt: torch.Tensor, y_spt: torch.Tensor,
                     x_qry: torch.Tensor, y_qry: torch.Tensor, n_inner_iter: int) -> torch.Tensor:
    """The program's inner loop in plain PyTorch (torch.func.functional_call and
    torch.autograd.grad): no metadist, no compat layer. The task's fast weights are
    ``p - lr * grad`` with the graph kept (TorchOpt's MetaSGD); buffers are copies
    (``detach_buffers=True``); BatchNorm runs on batch statistics throughout."""
    from torch.func import functional_call

    program = _program()
    params = dict(net.named_parameters())
    buffers = {name: b.detach().clone() for name, b in net.named_buffers()}
    for _ in range(n_inner_iter):
        out = functional_call(net, {**params, **buffers}, (x_spt,))
        grads = torch.autograd.grad(F.cross_entropy(out, y_spt), list(params.values()),
                                    create_graph=True)
        params = {name: p - program.INNER_LR * g
                  for (name, p), g in zip(params.items(), grads, strict=True)}
    return F.cross_entropy(functional_call(net, {**params, **buffers}, (x_qry,)), y_qry)


class _Local:
    """Stands in for an RRef when the program's own inner loop runs in this process."""

    def __init__(self, value: nn.Module) -> None:
        self.value = value

    def to_here(self) -> nn.Module:
        return self.value


def _program_inner_loop(net: nn.Module, *args: Any) -> torch.Tensor:
    """The program's inner loop (metadist.compat.torchopt's module_clone and MetaSGD) run
    in this process."""
    inner: Any = _program().inner_loop.__wrapped__
    return inner(_Local(net), *args)  # type: ignore[no-any-return]


def _reference(steps: int, inner_loop: Any = _plain_inner_loop) -> list[torch.Tensor]:
    """The program's training in one process: every task in turn through ``inner_loop``
    (plain PyTorch unless told), the mean of the losses, torch's SGD as the meta-optimizer."""
    program = _program()
    net = program.build_model()
    meta_opt = torch.optim.SGD(net.parameters(), lr=program.META_LR, momentum=0.9)
    for step in range(steps):
        x_spt, y_spt, x_qry, y_qry = program.sample_tasks(step)
        meta_opt.zero_grad()
        losses = [inner_loop(net, x_spt[i], y_spt[i], x_qry[i], y_qry[i], program.INNER_STEPS)
                  for i in range(program.TASKS)]
        torch.stack(losses).mean().backward()
        meta_opt.step()
    return [p.detach() for p in net.parameters()]


def _train(nproc: int, out: Path) -> tuple[dict[str, Any], str]:
    proc = _run(["-m", "metadist", "run", "--nproc", str(nproc), str(PROGRAM),
                 "--steps", str(STEPS), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out), proc.stdout


def test_torchopt_maml_layout_runs_under_metadist_run_and_matches_one_process(
        tmp_path: Path) -> None:
    two, two_out = _train(2, tmp_path / "two.pt")
    one, one_out = _train(1, tmp_path / "one.pt")
    assert (two["world_size"], one["world_size"]) == (2, 1)
    # Both workers initialised and served tasks (round-robin: tasks 1 and 3 on worker1).
    assert "worker init: worker0" in two_out and "worker init: worker1" in two_out
    assert two_out.count("task on worker1") == two_out.count("task on worker0") > 0
    assert "worker1" not in one_out
    assert len(two["losses"]) == STEPS
    for p, q in zip(two["params"], one["params"], strict=True):
        torch.testing.assert_close(p, q, **TOL)
    for p, q in zip(one["params"], _reference(STEPS), strict=True):
        torch.testing.assert_close(p, q, **TOL)
    # The evaluation sent the module itself (todist.rpc.RRef(net)); same loss both ways.
    assert two["eval"] == pytest.approx(one["eval"], rel=TOL["rtol"])


def test_the_reference_is_independent_of_the_compat_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The test of the test above: the program's own inner loop (the compat layer's
    module_clone/MetaSGD, in this process) agrees with the plain-PyTorch reference after a
    meta-step, and with the compat MetaSGD's learning rate made 1.5x it no longer does."""
    plain = _reference(1)
    for p, q in zip(_reference(1, _program_inner_loop), plain, strict=True):
        torch.testing.assert_close(p, q, **TOL)
    meta_sgd = _program().torchopt.MetaSGD
    init = meta_sgd.__init__

    def faster(self: Any, module: nn.Module, lr: float, *args: Any, **kwargs: Any) -> None:
        init(self, module, 1.5 * lr, *args, **kwargs)

    monkeypatch.setattr(meta_sgd, "__init__", faster)
    broken = _reference(1, _program_inner_loop)
    assert max((p - q).abs().max().item() for p, q in zip(broken, plain, strict=True)) > 1e-3


def test_every_public_name_of_torchopt_distributed() -> None:
    assert set(todist.__all__) == TORCHOPT_ALL
    assert all(hasattr(todist, name) for name in TORCHOPT_ALL)
    assert set(autograd.__all__) == TORCHOPT_AUTOGRAD_ALL
    assert all(getattr(autograd, name) is not None for name in TORCHOPT_AUTOGRAD_ALL)
    assert (todist.api, todist.world, todist.autograd) == (api, world, autograd)
    assert todist.is_available()


def test_rpc_is_torch_distributed_rpc() -> None:
    import torch.distributed.rpc

    assert todist.rpc is torch.distributed.rpc
    assert todist.rpc.RRef is torch.distributed.rpc.RRef


def _signature(func: Any) -> list[tuple[str, str, Any]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(func).parameters.values()]


def test_signatures_are_torchopts() -> None:
    empty = inspect.Parameter.empty
    call = [("func", "POSITIONAL_OR_KEYWORD", empty), ("args", "KEYWORD_ONLY", None),
            ("kwargs", "KEYWORD_ONLY", None), ("partitioner", "KEYWORD_ONLY", None),
            ("reducer", "KEYWORD_ONLY", None), ("timeout", "KEYWORD_ONLY", -1.0)]
    assert _signature(todist.remote_async_call) == call
    assert _signature(todist.remote_sync_call) == call
    decorator = [("partitioner", "POSITIONAL_OR_KEYWORD", None),
                 ("reducer", "POSITIONAL_OR_KEYWORD", None),
                 ("timeout", "POSITIONAL_OR_KEYWORD", -1.0)]
    for make in (todist.parallelize, todist.parallelize_async, todist.parallelize_sync):
        assert _signature(make) == decorator
    assert _signature(todist.barrier) == [("worker_names", "POSITIONAL_OR_KEYWORD", None)]
    assert [name for name, _, _ in _signature(todist.auto_init_rpc)][:4] == [
        "worker_init_fn", "worker_name_format", "backend", "rpc_backend_options"]
    assert [name for name, _, _ in _signature(autograd.grad)] == [
        "autograd_ctx_id", "outputs", "inputs", "retain_graph", "allow_unused"]
    assert [name for name, _, _ in _signature(autograd.backward)] == [
        "autograd_ctx_id", "tensors", "retain_graph", "inputs"]


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 0 of 2 (before init, world info comes from the environment)."""
    assert not metadist.is_initialized()
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)


def test_uneven_batch_splits_as_torchopt(two_workers: None) -> None:
    x = torch.arange(5)
    parts = todist.batch_partitioner(x)
    assert [(w, a[0].tolist(), k) for w, a, k in parts] == [(0, [0, 1], {}),
                                                              (1, [2, 3, 4], {})]
    # metadist's own partitioner spreads the remainder instead.
    native = mapreduce.batch_partitioner(x)
    assert [a[0].tolist() for _, a, _ in native] == [[0, 1, 2], [3, 4]]
    # Batch no larger than the workers: one sample per part.
    assert [a[0].tolist() for _, a, _ in todist.batch_partitioner(torch.arange(2))] == [[0], [1]]
    # Non-tensor arguments go to every part; exclusive parts are dealt round-robin.
    split = todist.dim_partitioner(1, exclusive=True, keepdim=False)(torch.ones(2, 3), scale=2)
    assert [(w, a[0].shape, k) for w, a, k in split] == [
        (0, torch.Size([2]), {"scale": 2}), (1, torch.Size([2]), {"scale": 2}),
        (0, torch.Size([2]), {"scale": 2})]


def test_partitioner_defaults_and_keepdim_error() -> None:
    assert _signature(todist.dim_partitioner) == [
        ("dim", "POSITIONAL_OR_KEYWORD", 0), ("exclusive", "KEYWORD_ONLY", False),
        ("keepdim", "KEYWORD_ONLY", True), ("workers", "KEYWORD_ONLY", None)]
    assert _signature(todist.TensorDimensionPartitioner.__init__)[1:] == [
        ("dim", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("exclusive", "KEYWORD_ONLY", False), ("keepdim", "KEYWORD_ONLY", False),
        ("workers", "KEYWORD_ONLY", None)]
    made = todist.dim_partitioner()
    assert isinstance(made, todist.TensorDimensionPartitioner)
    assert (made.dim, made.exclusive, made.keepdim, made.workers) == (0, False, True, None)
    with pytest.raises(ValueError, match=r"keepdim=False.*pass exclusive=True"):
        todist.TensorDimensionPartitioner(0)
    assert todist.TensorDimensionPartitioner(0, exclusive=True).keepdim is False
    with pytest.raises(ValueError, match="has no dimension 2"):
        todist.dim_partitioner(2)(torch.ones(3))


def test_worker_names_for_ten_or_more_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = world.default_worker_name_format
    assert fmt(world_rank=3, world_size=12, local_rank=3, local_world_size=12) == "worker03"
    assert fmt(world_rank=7, world_size=100, local_rank=7, local_world_size=8) == "worker007"
    assert fmt(world_rank=1, world_size=2, local_rank=1, local_world_size=2) == "worker1"
    assert world.WorldInfo(11, 12, 3, 4).worker_name == "worker11"
    assert not metadist.is_initialized()
    for name, value in {"RANK": "3", "WORLD_SIZE": "12", "LOCAL_RANK": "3",
                        "LOCAL_WORLD_SIZE": "12"}.items():
        monkeypatch.setenv(name, value)
    assert todist.get_world_info().worker_name == "worker03"
    assert todist.get_worker_id("worker11") == 11
    with pytest.raises(ValueError, match="no worker is named 'worker3'; the workers are: "
                                         "worker00, worker01"):
        todist.get_worker_id("worker3")


def test_world_info_has_torchopts_attributes(two_workers: None) -> None:
    info = todist.get_world_info()
    assert tuple(info) == (0, 2, 0, 2)
    assert (info.rank, info.world_rank, info.worker_name) == (0, 0, "worker0")
    assert isinstance(info, mapreduce.WorldInfo)
    assert (todist.get_world_info.rank, todist.get_world_info.WORLD_SIZE) == (0, 2)  # type: ignore[attr-defined]
    assert (todist.get_rank(), todist.get_local_world_size()) == (0, 2)


def test_engine_is_rpc_unless_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mapreduce.ENGINE_ENV, raising=False)
    from metadist.mapreduce import session

    assert session.choose_engine(None) == "spmd"  # metadist's own API keeps its default
    monkeypatch.setenv(mapreduce.ENGINE_ENV, "spmd")

    @todist.auto_init_rpc()
    def main() -> tuple[str, float]:
        return mapreduce.engine(), part_mean(torch.arange(5)).item()

    try:
        assert main() == ("spmd", 2.0)  # an explicit choice stands; one worker, one part
    finally:
        mapreduce.shutdown()
    with pytest.raises(ValueError, match="engine='mpi' is not known"):
        todist.auto_init_rpc(engine="mpi")


# --- two ranks, one RPC session: the remaining differences -------------------------------


def where(x: torch.Tensor) -> tuple[int, list[int]]:
    return todist.get_world_rank(), x.tolist()


@todist.parallelize()
def part_mean(x: torch.Tensor) -> torch.Tensor:
    return x.double().mean()


@todist.parallelize(partitioner=todist.batch_partitioner)
def part_sums(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def _errors(*calls: Any) -> list[str]:
    messages = []
    for call in calls:
        try:
            call()
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return messages


@todist.rank_zero_only
def _drive(facts: dict[str, Any]) -> None:
    x = torch.arange(5)
    facts["mean"] = part_mean(x).item()
    facts["sums"] = [s.item() for s in part_sums(x)]  # a partitioner and no reducer: a list
    future = todist.remote_async_call(where, args=(x,))
    facts["future"] = isinstance(future, torch._C.Future)  # torch.futures.Future derives too
    facts["parts"] = future.wait()
    facts["named"] = todist.remote_sync_call(where, args=(x,), partitioner="worker1")
    v = torch.arange(5.0, dtype=torch.float64, requires_grad=True)
    with todist.autograd.context() as context_id:
        (facts["grad"],) = todist.autograd.grad(context_id, part_mean(v), v)
    todist.barrier(["worker0"])  # only this worker: returns at once
    facts["errors"] = _errors(lambda: todist.barrier(["worker1"]),
                              lambda: todist.barrier(["worker0", "worker7"]),
                              lambda: todist.barrier("worker0"))


def _session_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {}

    @todist.auto_init_rpc(lambda: facts.setdefault("init", todist.get_world_info().worker_name))
    def main() -> None:
        facts["engine"] = mapreduce.engine()
        info = todist.get_world_info()
        facts["info"] = (info.rank, info.worker_name, todist.get_worker_id(info.worker_name))
        todist.barrier(["worker1", "worker0"])
        _drive(facts)
        todist.barrier()

    chosen = os.environ.pop(mapreduce.ENGINE_ENV, None)  # no engine setting (pooled ranks)
    try:
        main()
    finally:
        mapreduce.shutdown()
        if chosen is not None:
            os.environ[mapreduce.ENGINE_ENV] = chosen
    return facts


@pytest.fixture(scope="module")
def facts() -> list[dict[str, Any]]:
    return run_on_ranks(_session_facts, 2)


def test_default_engine_is_rpc_and_workers_are_named(facts: list[dict[str, Any]]) -> None:
    assert [f["engine"] for f in facts] == ["rpc", "rpc"]
    assert [f["init"] for f in facts] == ["worker0", "worker1"]
    assert [f["info"] for f in facts] == [(0, "worker0", 0), (1, "worker1", 1)]


def test_mean_reducer_is_the_unweighted_mean_of_torchopts_parts(
        facts: list[dict[str, Any]]) -> None:
    # Parts [0, 1] and [2, 3, 4]: (0.5 + 3.0) / 2 (metadist's own split gives 2.25).
    assert facts[0]["mean"] == 1.75
    weights = [0.25, 0.25, 1 / 6, 1 / 6, 1 / 6]
    torch.testing.assert_close(facts[0]["grad"], torch.tensor(weights, dtype=torch.float64))


def test_reducer_defaults_only_with_the_default_partitioner(
        facts: list[dict[str, Any]]) -> None:
    assert facts[0]["sums"] == [1, 9]


def test_remote_async_call_returns_a_torch_future(facts: list[dict[str, Any]]) -> None:
    assert facts[0]["future"]
    assert facts[0]["parts"] == [(0, [0, 1]), (1, [2, 3, 4])]
    assert facts[0]["named"] == [(1, [0, 1, 2, 3, 4])]


def test_barrier_of_named_workers(facts: list[dict[str, Any]]) -> None:
    not_named, unknown, string = facts[0]["errors"]
    assert "called on worker0, which is not among them" in not_named
    assert "no worker is named 'worker7'" in unknown
    assert "not one string" in string
