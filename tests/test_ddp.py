"""ddp/single/dp: parity with one process, the training API, and the registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metadist
from metadist.comm import stats
from metadist.testing import run_on_ranks
from parity import (
    assert_parity,
    batches,
    local_batch,
    loss_fn,
    make_net,
    make_optimizer,
    reference,
    shard,
    snapshot,
    train_on_rank,
)

WORLDS = [1, 2, 3, 4]
OPTIMIZERS = ["sgd", "adam", "adamw"]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("n", WORLDS)
def test_ddp_matches_single_process(n: int, optimizer: str, accumulate: int) -> None:
    if accumulate == 2 and n == 4:
        accumulate = 3  # 6 samples per rank: three micro-batches of 2
    want = reference(optimizer, accumulate, world=n)
    for rank, got in enumerate(run_on_ranks(train_on_rank, n, args=("ddp", optimizer, accumulate))):
        assert_parity(got, want, f"ddp n={n} rank={rank} {optimizer} acc={accumulate}")
        # The unused branch never got a gradient on any rank: it stays None, as in one process.
        assert got["grads_none"] == ["unused.bias", "unused.weight"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_single_strategy_is_plain_pytorch(optimizer: str) -> None:
    want = reference(optimizer)
    assert_parity(run_on_ranks(train_on_rank, 1, args=("single", optimizer))[0], want, "single")


def _bucketing(cap: float, first: float) -> dict[str, object]:
    return train_on_rank("ddp", "adam", options={"bucket_cap_mb": cap, "first_bucket_mb": first})


def test_tiny_buckets_give_the_same_result() -> None:
    # ~1 KiB buckets: many collectives, every parameter in its own bucket or two.
    want = reference("adam", world=3)
    for got in run_on_ranks(_bucketing, 3, args=(0.001, 0.0005)):
        assert_parity(got, want, "tiny buckets")


def _reduction_counts() -> tuple[int, int, list[int]]:
    net = make_net()
    s = metadist.strategy("ddp", sync_batchnorm=True, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    model, _ = s.setup(net, make_optimizer("sgd", net.parameters()))
    xs, ys = local_batch()
    buckets = len(model.reducer.buckets)
    with stats.counting() as one:
        loss_fn(model(xs), ys).backward()
    # The gradients are views into the bucket buffers: no copy after the all-reduce.
    views = [int(any(p.grad.data_ptr() == v.data_ptr() for b in model.reducer.buckets
                     for v in b.views)) for p in net.parameters() if p.grad is not None]
    return buckets, one.ops["all_reduce"].calls, views


def test_one_collective_per_bucket_and_grads_are_bucket_views() -> None:
    for buckets, calls, views in run_on_ranks(_reduction_counts, 2):
        # one all-reduce per bucket, plus SyncBatchNorm's statistics in forward and their
        # gradient in backward
        assert calls == buckets + 2
        assert all(views)


def _multi_backward_calls() -> tuple[int, int, int]:
    net = make_net(batchnorm=False)
    s = metadist.strategy("ddp")
    model, opt = s.setup(net, make_optimizer("sgd", net.parameters()))
    xs, ys = local_batch()
    buckets = len(model.reducer.buckets)
    with stats.counting() as counted:
        for _ in range(3):
            loss_fn(model(xs), ys).backward()
        opt.step()
    with stats.counting() as accumulated:
        with s.no_sync(model):
            for _ in range(2):
                loss_fn(model(xs), ys).backward()
        loss_fn(model(xs), ys).backward()
        opt.step()
    return buckets, counted.ops["all_reduce"].calls, accumulated.ops["all_reduce"].calls


def test_every_backward_ends_synced_and_no_sync_accumulates_locally() -> None:
    for buckets, calls, accumulated in run_on_ranks(_multi_backward_calls, 2):
        assert calls == 3 * buckets  # each backward syncs by its end, whatever steps next
        assert accumulated == buckets  # no_sync: one sync, in the backward after the block


def _several_backward_calls(n_backward: int) -> dict[str, object]:
    w = metadist.world()
    net = make_net(batchnorm=False)
    s = metadist.strategy("ddp")
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    for x, y in batches():
        opt.zero_grad()
        xs, ys = shard(x, w.rank, w.world_size), shard(y, w.rank, w.world_size)
        for part_x, part_y in zip(xs.chunk(n_backward), ys.chunk(n_backward), strict=True):
            (loss_fn(model(part_x), part_y) / n_backward).backward()
        opt.step()
    return snapshot(net, opt)


def test_several_backward_calls_per_step_match_single_process() -> None:
    want = reference("adam", accumulate=2, batchnorm=False, world=3)
    for got in run_on_ranks(_several_backward_calls, 3, args=(2,)):
        assert_parity(got, want, "two backward calls per step")


# ----- training API --------------------------------------------------------------------

def _api() -> dict[str, object]:
    w = metadist.world()
    s = metadist.strategy("ddp")
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt2 = s.setup(net, opt)
    x = torch.full((2, 4), float(w.rank + 1))
    model(x).sum().backward()
    norm = s.clip_grad_norm_(model, max_norm=1e-3)
    clipped = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    opt2.step()
    sched.step()
    return {
        "same_optimizer": opt2 is opt,
        "lr": opt2.param_groups[0]["lr"],
        "norm": norm.item(),
        "clipped": clipped,
        "metric": s.all_reduce(float(w.rank), "mean").item(),
        "max": s.all_reduce(torch.tensor(w.rank), "max").item(),
        "is_global_zero": s.is_global_zero,
        "world": s.world.world_size,
        "keys": sorted(model.state_dict()),
    }


def test_training_api() -> None:
    out = run_on_ranks(_api, 2)
    for rank, got in enumerate(out):
        assert got["same_optimizer"] and got["lr"] == 0.05
        # d/dW of sum(W x + b) over a batch of two rows of (rank + 1): 2 (rank + 1) per weight
        # and 2 per bias; averaged over ranks 3 and 2, so the global norm is sqrt(8*9 + 2*4).
        assert got["norm"] == pytest.approx(80**0.5)
        assert got["clipped"] == pytest.approx(1e-3, rel=1e-4)
        assert got["metric"] == 0.5 and got["max"] == 1
        assert got["is_global_zero"] == (rank == 0) and got["world"] == 2
        assert got["keys"] == ["bias", "weight"]  # checkpoints speak the user's module


def _starts_from_rank_zero(strategy: str) -> dict[str, list[float]]:
    rank = metadist.world().rank
    torch.manual_seed(rank)  # different init on every rank, parameters and buffers
    net = _Recorder()
    with torch.no_grad():
        net.b.uniform_()
    # broadcast_buffers=False: no forward broadcast could mask a buffer setup left behind
    model = metadist.strategy(strategy, broadcast_buffers=False).setup_module(net)
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_setup_broadcasts_rank_zeros_parameters_and_buffers(strategy: str) -> None:
    out = run_on_ranks(_starts_from_rank_zero, 3, args=(strategy,))
    assert sorted(out[0]) == ["b", "lin.bias", "lin.weight"]
    assert out[0] == out[1] == out[2]


class _Recorder(nn.Module):
    """Records the buffer each forward reads (before the forward updates it, as BatchNorm's
    running statistics are updated)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("b", torch.zeros(3))
        self.seen: list[list[float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.b.tolist())
        out = self.lin(x) + self.b
        with torch.no_grad():
            self.b.add_(x.mean(0))  # a local update: different on every rank
        return out


def _buffers_broadcast(strategy: str, broadcast_buffers: bool) -> list[list[float]]:
    rank = metadist.world().rank
    torch.manual_seed(0)
    net = _Recorder()
    model = metadist.strategy(strategy, broadcast_buffers=broadcast_buffers).setup_module(net)
    with torch.no_grad():
        net.b.fill_(10.0 * rank)  # the buffers differ per rank before the first forward
    x = torch.full((4, 3), float(rank + 1))
    model(x)
    model(x)  # each rank updated its buffer locally after the first forward
    # a per-rank task's forward: no collective (it may run on some ranks only)
    model.functional_forward(dict(net.named_parameters()), x)
    return net.seen


@pytest.mark.parametrize("broadcast_buffers", [True, False])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_buffers_broadcast_from_rank_zero_each_forward(strategy: str,
                                                       broadcast_buffers: bool) -> None:
    """What each forward of the model reads is rank 0's buffer, whatever the other ranks did
    to theirs since the last forward, and a per-rank task's forward on given parameters
    reads this rank's; with broadcast_buffers=False (the path disabled: the test of the
    test) each rank reads its own."""
    seen = run_on_ranks(_buffers_broadcast, 2, args=(strategy, broadcast_buffers))
    if broadcast_buffers:
        assert seen[0] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
        assert seen[1] == [[0.0] * 3, [1.0] * 3, [3.0] * 3]
    else:
        assert seen[0] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
        assert seen[1] == [[10.0] * 3, [12.0] * 3, [14.0] * 3]


def test_registry_errors_list_the_choices() -> None:
    with pytest.raises(ValueError, match=r"choose one of: single, dp, ddp"):
        metadist.strategy("zer2")
    with pytest.raises(ValueError, match=r"valid options: .*bucket_cap_mb"):
        metadist.strategy("ddp", bucket_mb=10)
    with pytest.raises(ValueError, match="positive"):
        metadist.strategy("ddp", bucket_cap_mb=0)
    assert "bucket_cap_mb=25.0" in repr(metadist.strategy("ddp"))


def test_dp_needs_two_gpus_and_says_to_use_ddp() -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has several GPUs; the dp error path does not apply")
    with pytest.raises(ValueError, match=r"use metadist.strategy\('ddp'\)"):
        metadist.strategy("dp").setup_module(nn.Linear(2, 2))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 3)
        self.branch = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.frozen(self.trunk(x))
        return self.branch(h) if use_branch else h


def _partly_used_branch() -> dict[str, object]:
    w = metadist.world()
    net = _Branchy()
    model, opt = metadist.strategy("ddp").setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.ones(2, 3) * (w.rank + 1)
    model(x, use_branch=w.rank == 0).sum().backward()  # only rank 0 reaches the branch
    branch = net.branch.weight.grad.clone()
    trainable = sum(b.numel for b in model.reducer.buckets)
    opt.step()
    return {"branch": branch, "frozen_grad": net.frozen.weight.grad, "trainable": trainable}


def test_a_parameter_used_on_some_ranks_is_averaged_with_zeros_elsewhere() -> None:
    out = run_on_ranks(_partly_used_branch, 2)
    net = _Branchy()
    net(torch.ones(2, 3), use_branch=True).sum().backward()  # rank 0's local gradient
    for got in out:
        torch.testing.assert_close(got["branch"], net.branch.weight.grad / 2)
        assert got["frozen_grad"] is None  # requires_grad=False: not synced, never touched
        assert got["trainable"] == 2 * (9 + 3)  # trunk and branch only
