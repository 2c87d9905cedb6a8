"""CUDA paths: skipped cleanly on machines without a GPU (CI never has one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import metadist
from metadist.testing import run_on_ranks
from parity import ATOL, assert_parity, reference, train_on_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _on_gpu(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    assert metadist.world().device.type == "cuda"
    got = train_on_rank(strategy, "adam", 1, True, options)
    return {k: {n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v
            for k, v in got.items()}


@pytest.mark.parametrize(("strategy", "options"), [
    ("ddp", {}),
    ("zero2", {}),
    ("zero3", {"min_unit_params": 40}),
    ("zero3", {"min_unit_params": 40, "cpu_offload": True}),
])
def test_strategies_on_one_gpu_match_the_cpu_reference(strategy: str,
                                                       options: dict[str, Any]) -> None:
    got = run_on_ranks(_on_gpu, 1, args=(strategy, options), backend=None)[0]
    assert_parity(got, reference("adam", world=1), f"{strategy} {options} on cuda")


def _offload_placement() -> dict[str, Any]:
    """zero3 with cpu_offload on cuda: where shards, gradients, optimizer state and the
    parameters the forward computes with live, observed inside and after a step."""
    from parity import loss_fn, make_net, make_optimizer

    net = make_net()
    s = metadist.strategy("zero3", min_unit_params=40, cpu_offload=True)
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    seen: set[str] = set()  # the devices of the parameters each Linear's forward reads
    for m in net.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, _: seen.add(mod.weight.device.type))
    x = torch.randn(4, 10, device=s.device)
    y = torch.randn(4, 3, device=s.device)
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        s.backward(loss_fn(out, y))
        opt.step()
    flats = [f for f in model.flats if f.shard.requires_grad]
    stepped = [p for g in opt.param_groups for p in g["params"]]
    return {
        "offload": all(f.offload for f in model.flats),
        "shards": {f.shard.device.type for f in model.flats},
        "pinned": all(f.shard.is_pinned() for f in model.flats),
        "grads": {f.shard.grad.device.type for f in flats if f.shard.grad is not None},
        "state": {v.device.type for f in flats for v in opt.state[f.shard].values()
                  if torch.is_tensor(v) and v.dim() > 0},
        "optimizer steps the shards": all(any(p is f.shard for p in stepped) for f in flats),
        "forward reads": seen, "output": out.device.type,
        "full buffers": {f.full.device.type for f in model.flats},
    }


def test_cpu_offload_keeps_shards_grads_and_state_on_the_cpu_and_computes_on_cuda() -> None:
    got = run_on_ranks(_offload_placement, 1, backend=None)[0]
    assert got == {
        "offload": True, "shards": {"cpu"}, "pinned": True, "grads": {"cpu"},
        "state": {"cpu"}, "optimizer steps the shards": True,
        "forward reads": {"cuda"}, "output": "cuda", "full buffers": {"cuda"},
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for NCCL")
def test_zero3_on_two_gpus_with_nccl() -> None:
    want = reference("adam", world=2)
    for got in run_on_ranks(_on_gpu, 2, args=("zero3", {"min_unit_params": 40}), backend=None):
        assert_parity(got, want, "zero3 nccl")


def _bf16() -> float:
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    s = metadist.strategy("zero3", min_unit_params=1, param_dtype="bfloat16",
                          reduce_dtype="float32")
    model, opt = s.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x = torch.randn(32, 64, device=s.device, dtype=torch.bfloat16)
    first = last = 0.0
    for i in range(20):
        opt.zero_grad()
        loss = model(x).float().square().mean()
        s.backward(loss)
        opt.step()
        first, last = (loss.item(), last) if i == 0 else (first, loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return last / first


def test_bf16_compute_on_gpu_trains() -> None:
    assert run_on_ranks(_bf16, 1, backend=None)[0] < 0.5 - ATOL


def _cpu_and_cuda_in_one_collective() -> str:
    out = torch.empty(4)
    try:
        metadist.comm.all_gather(out, torch.ones(2, device="cuda"))
    except ValueError as err:
        return str(err)
    return "no error"


def test_cpu_and_cuda_tensors_in_one_collective_are_refused() -> None:
    for message in run_on_ranks(_cpu_and_cuda_in_one_collective, 2, backend="gloo"):
        assert message == ("all_gather: tensors are on different devices (cpu, cuda:0); move "
                           "them to one device first")


def _cuda_rng_untouched_by_an_epoch() -> bool:
    from torch.utils.data import DataLoader, TensorDataset

    torch.cuda.manual_seed(123)
    before = torch.cuda.get_rng_state()
    loader = metadist.strategy("ddp").setup_dataloader(
        DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True))
    assert len(list(loader)) == 4
    return torch.equal(before, torch.cuda.get_rng_state())


def test_the_loaders_shuffle_leaves_the_cuda_generator_alone() -> None:
    # The epoch's order is drawn under a seeded CPU generator; the user's CUDA stream of
    # random numbers (dropout) must not be reseeded by it.
    assert run_on_ranks(_cuda_rng_untouched_by_an_epoch, 1, backend=None)[0]
