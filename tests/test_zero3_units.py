"""zero3 units fused from several small modules: gathered once per forward, freed after the
last of their members ran (in any order, with members skipped, repeated or recomputed), and
training that still matches one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.comm import stats
from metadist.strategies.zero3.strategy import ShardedModule
from metadist.testing import run_on_ranks, unique_storage_bytes
from parity import assert_tensors_close


def _gathered(model: ShardedModule) -> int:
    """Bytes of full (unsharded) buffers alive now; freed ones have an empty storage."""
    return unique_storage_bytes(flat.full for flat in model.flats)


def _unit_bytes(model: ShardedModule) -> int:
    return max(f.padded * f.full.element_size() for f in model.flats)


def _small_layers(prefetch: bool) -> dict[str, Any]:
    """Eight Linear(256, 256) (65,792 parameters each): the default min_unit_params=100,000
    fuses them in pairs. Gathered bytes after the forward and at worst inside it, per step."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    s = metadist.strategy("zero3", prefetch=prefetch)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, ShardedModule)
    peak = [0]
    for layer in net:
        for register in (layer.register_forward_pre_hook, layer.register_forward_hook):
            register(lambda *_: peak.__setitem__(0, max(peak[0], _gathered(model))))
    x = torch.randn(4, 256)
    steps = []
    for _ in range(3):
        peak[0] = 0
        with stats.counting() as traffic:
            opt.zero_grad()
            loss = model(x).square().mean()
            after_forward = _gathered(model)
            loss.backward()
            after_backward = _gathered(model)
            opt.step()
        steps.append({"after_forward": after_forward, "peak": peak[0],
                      "after_backward": after_backward,
                      "reduce_scatters": traffic.ops["reduce_scatter"].calls})
    with torch.no_grad():
        model(x)
    return {"members": [len(u.modules) for u in model.units if u.flats], "steps": steps,
            "no_grad": _gathered(model), "unit": _unit_bytes(model)}


@pytest.mark.parametrize("n", [2, 3])
def test_fused_units_are_freed_after_their_last_member(n: int) -> None:
    for prefetch in (True, False):
        for got in run_on_ranks(_small_layers, n, args=(prefetch,)):
            assert got["members"] == [2, 2, 2, 2]  # four fused units, no root parameters
            unit = got["unit"]
            for i, step in enumerate(got["steps"]):
                where = f"n={n} prefetch={prefetch} step {i}: {step}, unit {unit}"
                # the unit computing, and the next one while it is prefetched
                assert step["peak"] <= (2 if prefetch else 1) * unit, where
                # from the second step on, the last unit stays gathered for backward
                assert step["after_forward"] == (unit if i else 0), where
                assert step["after_backward"] == 0, where
                assert step["reduce_scatters"] == 4, where  # one per unit, not per member
            assert got["no_grad"] == 0


# ----- parity under irregular forwards ----------------------------------------------------

FEATURES = 8
PATTERNS = [  # layer indices a forward applies; units are (0, 1), (2, 3), (4, 5)
    [0, 1, 2, 3, 4, 5],
    [5, 4, 3, 2, 1, 0],  # each unit's second member runs first
    [0, 1, 2, 4, 5],  # member 3 skipped: its unit is closed when the next one starts
    [0, 2, 1, 3, 4, 5],  # interleaved: units closed and gathered again
    [0, 1, 0, 2, 3, 4, 5],  # a member run twice
]


class Layers(nn.Module):
    """Six small layers as direct children of the root (so the size policy fuses them) and a
    head too small for a unit of its own (the root unit)."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(6):
            self.add_module(f"l{i}", nn.Linear(FEATURES, FEATURES))
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for i in order:
            x = torch.tanh(getattr(self, f"l{i}")(x))
        return self.head(x)


def _objective(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    order = PATTERNS[step % len(PATTERNS)]
    out = model(x, order)
    if step % 2:  # two forwards into one backward, as an inner loop calling the model again
        out = out + model(0.5 * x, PATTERNS[0])
    return ((out - y) ** 2).mean()


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, FEATURES, generator=g), torch.randn(12, 1, generator=g))
            for _ in range(steps)]


# Plain SGD: a member skipped by a step gets a zero gradient in its unit's flat shard, where a
# single process leaves it without one; Adam or momentum would still move it, SGD does not.
def _reference(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = Layers()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_data(steps)):
        opt.zero_grad()
        _objective(net, x, y, step).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train(options: dict[str, Any], steps: int) -> tuple[dict[str, torch.Tensor], int, int]:
    torch.manual_seed(0)
    net = Layers()
    s = metadist.strategy("zero3", min_unit_params=100, **options)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, ShardedModule)
    w = metadist.world()
    worst = 0
    for step, (x, y) in enumerate(_data(steps)):
        xs, ys = x.chunk(w.world_size)[w.rank], y.chunk(w.world_size)[w.rank]
        with torch.no_grad():  # an evaluation forward between steps changes nothing
            model(xs, PATTERNS[0])
        opt.zero_grad()
        loss = _objective(model, xs, ys, step)
        worst = max(worst, _gathered(model))
        s.backward(loss)
        opt.step()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, worst,
            _unit_bytes(model))


@pytest.mark.parametrize("options", [
    {}, {"prefetch": False}, {"reshard_after_forward": False},
    {"activation_checkpointing": nn.Linear},  # members recomputed inside backward
], ids=["default", "no-prefetch", "no-reshard", "checkpointed"])
@pytest.mark.parametrize("n", [2, 3])
def test_fused_units_train_like_one_process_under_irregular_forwards(
        n: int, options: dict[str, Any]) -> None:
    steps = 2 * len(PATTERNS)
    want = _reference(steps)
    for state, worst, unit in run_on_ranks(_train, n, args=(options, steps)):
        assert_tensors_close(state, want, f"n={n} {options}")
        if options.get("reshard_after_forward", True):
            # after a forward: the unit kept for backward, and one whose prediction missed
            assert worst <= 2 * unit + 64, (worst, unit)


class Stack(nn.Module):
    """Blocks in a ModuleList and scales in a ParameterList: containers whose forward never
    runs, so neither may be a unit (their hooks would never fire)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(FEATURES, FEATURES) for _ in range(5))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(FEATURES)) for _ in range(5))
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, scale in zip(self.blocks, self.scales, strict=True):
            x = torch.tanh(block(x)) * scale
        return self.head(x)


def _train_stack(min_unit_params: int, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = Stack()
    s = metadist.strategy("zero3", min_unit_params=min_unit_params)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    w = metadist.world()
    for x, y in _data(steps):
        xs, ys = x.chunk(w.world_size)[w.rank], y.chunk(w.world_size)[w.rank]
        opt.zero_grad()
        s.backward(((model(xs) - ys) ** 2).mean())
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("min_unit_params", [10, 100, 250])  # per block, pairs, the whole list
def test_containers_without_a_forward_are_never_units(min_unit_params: int) -> None:
    from metadist.strategies.zero3.wrap import plan_units

    plans = plan_units(Stack(), min_unit_params)
    members = [type(m).__name__ for plan in plans for m in plan.modules]
    assert not {"ModuleList", "ParameterList"} & set(members), members
    torch.manual_seed(0)
    net = Stack()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for x, y in _data(10):
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    for state in run_on_ranks(_train_stack, 2, args=(min_unit_params, 10)):
        assert_tensors_close(state, net.state_dict(), f"min_unit_params={min_unit_params}")
