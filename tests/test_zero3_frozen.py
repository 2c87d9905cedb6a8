"""zero3 with frozen parameters (``requires_grad=False``): a frozen unit the graph goes through
is gathered again for backward (the input gradient reads its weights) and freed after it; its
parameters get no gradient, no reduce-scatter and never change. Frozen layers at the start
(no backward at all), in the middle, at the end, frozen and trainable parameters in one unit,
and second-order use, each against one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import metadist
from metadist.comm import stats
from metadist.strategies.zero3.strategy import ShardedModule
from metadist.testing import run_on_ranks, unique_storage_bytes
from parity import assert_tensors_close

FEATURES, OUT, BATCH, STEPS = 8, 2, 12, 10  # BATCH splits evenly over 2 and 3 ranks


class Chain(nn.Module):
    """Five Linear(8, 8) with tanh and a Linear(8, 2) head, all direct children of the root:
    ``min_unit_params=10`` makes each a unit, ``100`` fuses them in pairs (l0+l1, l2+l3) and
    leaves l4 and the head to the root unit. ``probe`` (if set) runs in backward at every
    layer boundary, where it can look at what is gathered."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(5):
            self.add_module(f"l{i}", nn.Linear(FEATURES, FEATURES))
        self.head = nn.Linear(FEATURES, OUT)
        self.probe: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(5):
            x = torch.tanh(getattr(self, f"l{i}")(x))
            if self.probe is not None and x.requires_grad:
                x.register_hook(lambda g, probe=self.probe: probe())
        out: torch.Tensor = self.head(x)
        return out


def _freeze(net: Chain, case: str) -> None:
    names = {
        "middle": ["l2.weight", "l2.bias"],
        "first": ["l0.weight", "l0.bias", "l1.weight", "l1.bias"],  # no backward reaches them
        "last": ["l4.weight", "l4.bias", "head.weight", "head.bias"],
        "backbone": [f"l{i}.{k}" for i in (1, 2, 3) for k in ("weight", "bias")],
        # frozen and trainable parameters in one unit: l2's weight (bias trains), l0's bias
        # (the first unit: its input needs no gradient, yet its output does)
        "partial": ["l2.weight", "l0.bias"],
        # with min_unit_params=100: units (l0, l1) and (l2, l3) each fuse a frozen member
        # with a trainable one
        "fused": ["l1.weight", "l1.bias", "l2.weight", "l2.bias"],
    }[case]
    for name, p in net.named_parameters():
        if name in names:
            p.requires_grad_(False)


def _make(case: str) -> Chain:
    torch.manual_seed(0)
    net = Chain()
    _freeze(net, case)
    return net


def _min_unit(case: str) -> int:
    return 100 if case == "fused" else 10


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUT, generator=g))
            for _ in range(STEPS)]


def _reference(case: str) -> dict[str, torch.Tensor]:
    net = _make(case)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for x, y in _data():
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _gathered(model: ShardedModule) -> int:
    """Bytes of full (unsharded) buffers alive now; freed ones have an empty storage."""
    return unique_storage_bytes(flat.full for flat in model.flats)


def _frozen_gathered(model: ShardedModule) -> int:
    return unique_storage_bytes(f.full for f in model.flats if not f.shard.requires_grad)


def _unit_bytes(model: ShardedModule) -> tuple[int, int]:
    """(the largest unit's full parameters, the root unit's), in bytes."""
    def size(unit: Any) -> int:
        return sum(f.padded * f.full.element_size() for f in unit.flats)
    return max(size(u) for u in model.units if not u.is_root), size(model.units[-1])


def _train(case: str, options: dict[str, Any]) -> dict[str, Any]:
    net = _make(case)
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
    frozen_names = [n for n, p in net.named_parameters() if not p.requires_grad]
    s = metadist.strategy("zero3", min_unit_params=_min_unit(case), **options)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    assert isinstance(model, ShardedModule)
    w = metadist.world()
    peak = [0]
    net.probe = lambda: peak.__setitem__(0, max(peak[0], _gathered(model)))
    frozen = [f for f in model.flats if not f.shard.requires_grad]
    trainable = [f for f in model.flats if f.shard.requires_grad]
    steps = []
    for x, y in _data():
        xs, ys = x.chunk(w.world_size)[w.rank], y.chunk(w.world_size)[w.rank]
        with torch.no_grad():  # an evaluation forward leaves nothing gathered for a backward
            model(xs)
        no_grad = _frozen_gathered(model)
        peak[0] = 0
        with stats.counting() as traffic:
            opt.zero_grad()
            loss = ((model(xs) - ys) ** 2).mean()
            after_forward = _frozen_gathered(model)
            s.backward(loss)
            after_backward = _gathered(model)
            opt.step()
        steps.append({"no_grad": no_grad, "after_forward": after_forward,
                      "after_backward": after_backward, "peak": peak[0],
                      "reduce_scatters": traffic.ops["reduce_scatter"].calls,
                      "sent": traffic.wire_bytes,
                      "frozen_grads": [f.shard.grad is not None for f in frozen]})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # zero3.md's bound: (3 Psi_t + 2 Psi_f)(N-1)/N, Psi_f(N-1)/N for frozen layers no
    # gradient reaches (full buffers, padding included)
    psi_t, psi_f = (sum(f.padded * f.full.element_size() for f in flats)
                    for flats in (trainable, frozen))
    bound = (3 * psi_t + (1 if case == "first" else 2) * psi_f) * (w.world_size - 1)
    return {"state": state, "initial": {n: initial[n] for n in frozen_names},
            "steps": steps, "unit": _unit_bytes(model), "trainable": len(trainable),
            "bound": bound / w.world_size}


OPTIONS = [{}, {"prefetch": False}, {"reshard_after_forward": False},
           {"activation_checkpointing": nn.Linear}]
OPTION_IDS = ["default", "no-prefetch", "no-reshard", "checkpointed"]


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("case", ["middle", "first", "last", "backbone", "partial", "fused"])
@pytest.mark.parametrize("n", [2, 3])
def test_frozen_units_train_like_one_process(n: int, case: str,
                                             options: dict[str, Any]) -> None:
    want = _reference(case)
    out = run_on_ranks(_train, n, args=(case, options))
    for rank, got in enumerate(out):
        where = f"n={n} {case} {options} rank {rank}"
        assert_tensors_close(got["state"], want, where)
        for name, value in got["initial"].items():  # frozen: untouched, on every rank
            assert torch.equal(got["state"][name], value), f"{where}: frozen {name} moved"
            assert torch.equal(got["state"][name], out[0]["state"][name]), where
        unit, root = got["unit"]
        for i, step in enumerate(got["steps"]):
            at = f"{where} step {i}: {step}, unit {unit}"
            assert step["after_backward"] == 0, at  # back to the shards only
            assert step["no_grad"] == 0, at  # nothing kept for a backward that cannot come
            assert not any(step["frozen_grads"]), at  # no gradient memory for frozen shards
            assert step["reduce_scatters"] == got["trainable"], at  # none for frozen shards
            assert step["sent"] <= got["bound"], (at, got["bound"])
            if case == "first":  # no graph goes through them: freed after their forward
                assert step["after_forward"] == 0, at
            if options.get("reshard_after_forward", True):
                # a frozen unit is freed after its backward, not at the end of it: in the
                # backbone (three frozen units in a row) at most this unit and the next one
                # (+ the root unit: l4 and the head when fused)
                assert step["peak"] <= 2 * unit + root, at


# ----- second order -----------------------------------------------------------------------

INNER_STEPS, INNER_LR, TASKS = 2, 0.1, 6  # TASKS splits evenly over 2 and 3 ranks


def _tasks(step: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(100 + step)
    return [tuple(torch.randn(4, FEATURES if i % 2 == 0 else OUT, generator=g)
                  for i in range(4)) for _ in range(TASKS)]


def _adapt(forward: Callable[..., torch.Tensor], params: dict[str, torch.Tensor],
           x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    for _ in range(INNER_STEPS):
        loss = ((forward(params, x) - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {n: p - INNER_LR * g for (n, p), g in zip(params.items(), grads, strict=True)}
    return params


def _maml_reference() -> dict[str, torch.Tensor]:
    net = _make("middle")
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)

    def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(net, params, (x,))
        return out

    for step in range(STEPS // 2):
        opt.zero_grad()
        for xs, ys, xq, yq in _tasks(step):
            fast = _adapt(forward, {n: p for n, p in net.named_parameters()
                                    if p.requires_grad}, xs, ys)
            (((forward(fast, xq) - yq) ** 2).mean() / TASKS).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _maml(options: dict[str, Any]) -> dict[str, Any]:
    """Second-order MAML through a frozen middle unit: fast weights adapted with
    ``create_graph=True`` (the inner gradients run through the frozen layer, and the outer
    backward through those gradients reads its weights again)."""
    w = metadist.world()
    net = _make("middle")
    s = metadist.strategy("zero3", min_unit_params=10, **options)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    assert isinstance(model, ShardedModule)
    per = TASKS // w.world_size
    after = []
    for step in range(STEPS // 2):
        opt.zero_grad()
        for xs, ys, xq, yq in _tasks(step)[w.rank * per:(w.rank + 1) * per]:
            fast = _adapt(model.functional_forward, model.full_parameters(), xs, ys)
            s.backward(((model.functional_forward(fast, xq) - yq) ** 2).mean() / per)
            after.append(_gathered(model))
        opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "after_backward": after}


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("n", [2, 3])
def test_maml_through_a_frozen_unit_matches_one_process(n: int, options: dict[str, Any]) -> None:
    want = _maml_reference()
    for rank, got in enumerate(run_on_ranks(_maml, n, args=(options,))):
        assert_tensors_close(got["state"], want, f"n={n} {options} rank {rank}")
        assert got["after_backward"] == [0] * len(got["after_backward"]), got


PENALTY = 0.1


def _penalty_reference() -> dict[str, torch.Tensor]:
    net = _make("middle")
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    trainable = [p for p in net.parameters() if p.requires_grad]
    for x, y in _data():
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        grads = torch.autograd.grad(loss, trainable, create_graph=True)
        (loss + PENALTY * sum((g ** 2).sum() for g in grads)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _penalty(options: dict[str, Any]) -> dict[str, Any]:
    """A gradient-norm penalty through the module's own forward: the first backward
    (``create_graph=True``) goes through the frozen unit and records nodes that read its
    weights; the second backward runs them."""
    w = metadist.world()
    net = _make("middle")
    s = metadist.strategy("zero3", min_unit_params=10, **options)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    assert isinstance(model, ShardedModule)
    shards = [p for p in model.parameters() if p.requires_grad]  # slices of the shards
    after = []
    for x, y in _data():
        xs, ys = x.chunk(w.world_size)[w.rank], y.chunk(w.world_size)[w.rank]
        opt.zero_grad()
        loss = ((model(xs) - ys) ** 2).mean()
        # this rank's shard of the gradient of the global loss (the unshard's reduce-scatter
        # is differentiable): the ranks' penalties sum to the whole one, and the strategy
        # averages the ranks' objectives, hence the factor N
        with model.reduced_shard_grads():  # asked for on purpose: raises otherwise
            grads = torch.autograd.grad(loss, shards, create_graph=True)
        penalty = sum((g ** 2).sum() for g in grads)
        s.backward(loss + PENALTY * w.world_size * penalty)
        after.append(_gathered(model))
        opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "after_backward": after}


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("n", [2, 3])
def test_gradient_penalty_through_a_frozen_unit_matches_one_process(
        n: int, options: dict[str, Any]) -> None:
    want = _penalty_reference()
    for rank, got in enumerate(run_on_ranks(_penalty, n, args=(options,))):
        assert_tensors_close(got["state"], want, f"n={n} {options} rank {rank}")
        assert got["after_backward"] == [0] * len(got["after_backward"]), got
