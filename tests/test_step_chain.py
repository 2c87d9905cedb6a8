"""The ordered chain around ``optimizer.step()`` (strategies/step_chain.py): the strategy's
and the loss scaler's phases run in their documented order, and hooks the user registers on
the optimizer see what they saw before: synced, unscaled gradients before the step, refreshed
parameters and the updated scale after it."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import metadist
from metadist.strategies.step_chain import chain_of
from metadist.testing import assert_same_on_all_ranks, run_on_ranks
from parity import assert_tensors_close, batches, loss_fn, make_net, micro, shard

STEPS = 10
CLOSURE_FROM = 6  # later steps pass a closure to step(): it runs after the pre phases


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def _reference(world: int) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """One process: the gradients each step applies, and the parameters after it."""
    net = make_net(batchnorm=False)
    opt = _sgd(net.parameters())
    sched = _scheduler(opt)
    grads, params = [], []
    for x, y in batches(STEPS):
        opt.zero_grad()
        parts = [(micro(shard(x, r, world), 2), micro(shard(y, r, world), 2))
                 for r in range(world)]
        for j in range(2):
            xj = torch.cat([px[j] for px, _ in parts])
            yj = torch.cat([py[j] for _, py in parts])
            (loss_fn(net(xj), yj) / 2).backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()
                      if p.grad is not None})
        opt.step()
        sched.step()
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return grads, params


def _hooked_training(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Both micro-batches under no_sync (the "sync_grads" phase does the sync), an LR
    scheduler bound to the optimizer, a closure on the last steps, and user hooks."""
    w = metadist.world()
    s = metadist.strategy(name, **options)
    net = make_net(batchnorm=False)
    names = {id(p): n for n, p in net.named_parameters()}
    model, opt = s.setup(net, _sgd(net.parameters()))
    sched = _scheduler(opt)  # bound to the set-up optimizer, as with a plain one
    seen_grads: list[dict[str, torch.Tensor]] = []
    seen_params: list[dict[str, torch.Tensor]] = []

    def user_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        seen_grads.append({names[id(p)]: p.grad.clone() for g in optimizer.param_groups
                           for p in g["params"] if p.grad is not None})

    def user_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state = model.state_dict()  # the user's keys; waits for an overlapped refresh
        seen_params.append({n: state[n].clone() for n in names.values()})

    opt.register_step_pre_hook(user_pre)
    opt.register_step_post_hook(user_post)
    for step, (x, y) in enumerate(batches(STEPS)):
        xs = micro(shard(x, w.rank, w.world_size), 2)
        ys = micro(shard(y, w.rank, w.world_size), 2)

        def closure(xs: list[torch.Tensor] = xs, ys: list[torch.Tensor] = ys) -> torch.Tensor:
            opt.zero_grad()
            losses = [loss_fn(model(xj), yj) / 2 for xj, yj in zip(xs, ys, strict=True)]
            s.backward(losses[0] + losses[1])
            return losses[0] + losses[1]

        if step >= CLOSURE_FROM:
            opt.step(closure)
        else:
            opt.zero_grad()
            with s.no_sync(model):
                for xj, yj in zip(xs, ys, strict=True):
                    s.backward(loss_fn(model(xj), yj) / 2)
            opt.step()
        sched.step()
    for n, t in seen_params[-1].items():
        assert_same_on_all_ranks(t, n)
    chain = chain_of(opt)
    assert chain is not None
    return {"grads": seen_grads, "params": seen_params, "phases": chain.phases()}


@pytest.mark.parametrize(("name", "ranks", "options", "phases"), [
    ("ddp", 2, {}, ["agree", "sync_grads"]),
    ("zero2", 3, {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0005},
     ["agree", "sync_grads", "wait_params", "refresh_params"]),
])
def test_user_hooks_see_synced_grads_and_refreshed_params(
        name: str, ranks: int, options: dict[str, Any], phases: list[str]) -> None:
    want_grads, want_params = _reference(ranks)
    out = run_on_ranks(_hooked_training, ranks, args=(name, options))
    for step in range(CLOSURE_FROM):  # every gradient is stepped (under zero2 by its owner)
        stepped = {n for got in out for n in got["grads"][step]}
        assert sorted(stepped) == sorted(want_grads[step]), step
    for rank, got in enumerate(out):
        assert got["phases"] == phases
        for step in range(CLOSURE_FROM):  # grads before step(): what it applies, synced
            owned = got["grads"][step]
            assert_tensors_close(owned, {n: want_grads[step][n] for n in owned},
                                 f"rank {rank} step {step} grads")
        for step in range(STEPS):  # params after step(): refreshed on every rank
            assert_tensors_close(got["params"][step], want_params[step],
                                 f"rank {rank} step {step} params")


def _overflow_hooks(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """16-mixed where rank 1 alone overflows at step 3; user hooks record what they see."""
    w = metadist.world()
    s = metadist.strategy(name, precision="16-mixed", **options)
    scaler = s.scaler
    assert scaler is not None
    net = make_net(batchnorm=False)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    before: list[tuple[float, int]] = []  # (scale the grads carry, gradients left)
    after: list[tuple[float, bool]] = []  # (scale, skipped)
    opt.register_step_pre_hook(lambda o, *_: before.append(
        (scaler.current_scale(), sum(p.grad is not None for g in o.param_groups
                                     for p in g["params"]))))
    opt.register_step_post_hook(lambda *_: after.append(
        (scaler.scale_value, scaler.last_step_skipped)))
    for step, (x, y) in enumerate(batches(6)):
        opt.zero_grad()
        out = model(shard(x, w.rank, w.world_size))
        if step == 3 and w.rank == 1:
            out = out * float("inf")
        s.backward(loss_fn(out, shard(y, w.rank, w.world_size)))
        opt.step()
    for n, t in model.state_dict().items():
        assert_same_on_all_ranks(t, n)
    chain = chain_of(opt)
    assert chain is not None
    return {"before": before, "after": after, "phases": chain.phases()}


def test_overflow_skip_runs_every_phase_in_order() -> None:
    full = 2.0**16
    options = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0005}
    out = run_on_ranks(_overflow_hooks, 2, args=("zero2", options))
    # before step(): the overflowing step's gradients dropped on every rank, none other's
    left = [sum(got["before"][i][1] for got in out) for i in range(6)]
    assert [n == 0 for n in left] == [i == 3 for i in range(6)]
    for got in out:
        assert got["phases"] == ["agree", "sync_grads", "wait_params", "unscale",
                                 "refresh_params", "update_scale"]
        assert [scale for scale, _ in got["before"]] == [1.0] * 6  # unscaled
        # after step(): the scale already updated (backed off at the skipped step)
        assert got["after"] == [(full if i < 3 else full / 2, i == 3) for i in range(6)]


def test_zero3_drops_gathered_copies_before_the_scale_update() -> None:
    s = metadist.strategy("zero3", precision="16-mixed", min_unit_params=40)
    net = make_net(batchnorm=False)
    _, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    chain = chain_of(opt)
    assert chain is not None
    # unreached parameters are set aside after the unscale (which may drop the gradients)
    # and put back before the gathered copies are dropped
    assert chain.phases() == ["unscale", "skip_unreached", "restore_unreached",
                              "shards_changed", "update_scale"]


def test_an_optimizer_set_up_twice_is_refused() -> None:
    s = metadist.strategy("single", precision="16-mixed")
    net = make_net(batchnorm=False)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    chain = chain_of(opt)
    assert chain is not None and chain.phases() == ["unscale", "update_scale"]
    with pytest.raises(ValueError, match=r"this SGD is already set up by a strategy; build a "
                                         r"new optimizer"):
        s.setup_optimizer(model, opt)
    assert chain_of(opt) is chain and chain.phases() == ["unscale", "update_scale"]


def test_a_set_up_optimizer_is_freed_when_dropped() -> None:
    # The scaler's phase holds the optimizer: nothing outside it may keep the chain alive.
    s = metadist.strategy("single", precision="16-mixed")
    net = make_net(batchnorm=False)
    _model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
