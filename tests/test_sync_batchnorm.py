"""SyncBatchNorm equals one BatchNorm over the global batch: outputs, gradients (first and
second order), running statistics; on uneven per-rank batches too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metadist
from metadist import SyncBatchNorm
from metadist.strategies.batchnorm.sync import convert_sync_batchnorm
from metadist.testing import run_on_ranks

SIZES = {2: [3, 5], 3: [4, 2, 6]}  # uneven local batches


def _data(dims: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (total, 4) if dims == 2 else (total, 4, 3, 2)
    return torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1, torch.randn(
        shape, generator=g, dtype=torch.float64)


def _bn(dims: int, sync: bool) -> nn.Module:
    torch.manual_seed(1)
    bn: nn.Module = nn.BatchNorm1d(4) if dims == 2 else nn.BatchNorm2d(4)
    bn = bn.double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return convert_sync_batchnorm(bn) if sync else bn


def _run(bn: nn.Module, x: torch.Tensor, w: torch.Tensor, steps: int = 3) -> dict[str, object]:
    x = x.clone().requires_grad_(True)
    for _ in range(steps):
        y = bn(x)
    loss = (torch.sin(y) * w).sum()
    gx, gw, gb = torch.autograd.grad(loss, [x, bn.weight, bn.bias], create_graph=True)
    # second order: differentiate the input-gradient's norm again
    (hx, hw) = torch.autograd.grad((gx**2).sum(), [x, bn.weight])
    bn.eval()
    y_eval = bn(x.detach())
    return {"y": y.detach(), "gx": gx.detach(), "gw": gw.detach(), "gb": gb.detach(),
            "hx": hx, "hw": hw, "mean": bn.running_mean.clone(), "var": bn.running_var.clone(),
            "tracked": bn.num_batches_tracked.item(), "eval": y_eval.detach()}


def _on_rank(dims: int) -> dict[str, object]:
    w_ = metadist.world()
    sizes = SIZES[w_.world_size]
    x, w = _data(dims, sum(sizes))
    lo = sum(sizes[:w_.rank])
    hi = lo + sizes[w_.rank]
    bn = _bn(dims, sync=True)
    assert isinstance(bn, SyncBatchNorm)
    out = _run(bn, x[lo:hi], w[lo:hi])
    out["slice"] = (lo, hi)
    return out


@pytest.mark.parametrize("dims", [2, 4])
@pytest.mark.parametrize("n", [2, 3])
def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(n: int, dims: int) -> None:
    x, w = _data(dims, sum(SIZES[n]))
    want = _run(_bn(dims, sync=False), x, w)
    reduced = {"gw", "gb", "hw"}  # parameter gradients: each rank holds its share; they sum
    got = run_on_ranks(_on_rank, n, args=(dims,))
    for key in reduced:
        torch.testing.assert_close(sum(r[key] for r in got), want[key])
    for rank in got:
        lo, hi = rank["slice"]
        for key in ("y", "gx", "hx", "eval"):
            torch.testing.assert_close(rank[key], want[key][lo:hi],
                                       msg=lambda m, k=key: f"{k}: {m}")
        for key in ("mean", "var"):
            torch.testing.assert_close(rank[key], want[key])
        assert rank["tracked"] == want["tracked"]


def test_one_rank_and_eval_are_plain_batchnorm() -> None:
    x, w = _data(2, 6)
    want = _run(_bn(2, sync=False), x, w)
    got = run_on_ranks(_run, 1, args=(_bn(2, sync=True), x, w))[0]
    for key in want:
        if key != "tracked":
            torch.testing.assert_close(got[key], want[key])


def test_conversion_keeps_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm2d(2)))
    weight, mean = model[1].weight, model[1].running_mean
    converted = convert_sync_batchnorm(model)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][0], SyncBatchNorm)
    assert model[1].weight is weight and model[1].running_mean is mean
    with pytest.raises(ValueError, match=r"\(N, C, ...\)"):
        model[1](torch.ones(3))
