"""zero3 units' lifetime (strategies/zero3/unit_state.py): the states a training step walks
through with and without ``reshard_after_forward``, prefetch included, and a transition the
table does not have caught as an internal error naming both states."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.strategies.zero3.strategy import ShardedModule
from metadist.strategies.zero3.unit_state import UnitState, check_transition
from metadist.testing import run_on_ranks


def _states(model: ShardedModule) -> list[str]:
    return [unit.state.name for unit in model.units]


def _walk(reshard: bool, prefetch: bool = True) -> dict[str, list[Any]]:
    """The units' states (four Linear units, then the root unit) at points of the 2nd step,
    and which units are gathered (or their gather in flight) once the backward reached the
    3rd unit's output: its own, and the 2nd prefetched for the backward."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    s = metadist.strategy("zero3", min_unit_params=20, reshard_after_forward=reshard,
                          prefetch=prefetch)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, ShardedModule)
    seen: dict[str, list[str]] = {}
    # registered after the strategy's hook: sees the unit opened
    def probe(*_: object) -> None:
        seen.setdefault("in 2nd unit", _states(model))

    net[1].register_forward_pre_hook(probe)

    def in_backward(_: torch.Tensor) -> None:  # after the unit's own hook on that output
        seen.setdefault("gathered in 3rd unit's backward",
                        [any(f.gathered for f in unit.flats) for unit in model.units])

    net[2].register_forward_hook(lambda _m, _a, out: out.register_hook(in_backward) and None)
    for _ in range(2):
        seen.clear()
        loss = model(torch.randn(4, 8)).square().mean()
        seen["after forward"] = _states(model)
        loss.backward()
        seen["after backward"] = _states(model)
        opt.step()
        seen["after step"] = _states(model)
    return seen


def test_a_step_walks_each_unit_through_its_states() -> None:
    s, p, f, g = "SHARDED", "PREFETCHED", "FORWARD", "GATHERED"
    yes, no = True, False
    for seen in run_on_ranks(_walk, 2, args=(True,)):
        assert seen == {"in 2nd unit": [s, f, p, s, g],  # the 3rd is prefetched
                        "after forward": [s, s, s, g, g],  # the last is the first of backward
                        # the 3rd unit's own gather and the 2nd prefetched for the backward
                        "gathered in 3rd unit's backward": [no, yes, yes, no, no],
                        "after backward": [s] * 5,
                        "after step": [s] * 5}, seen
    for seen in run_on_ranks(_walk, 2, args=(False,)):
        assert seen == {"in 2nd unit": [g, f, p, s, g],  # the 1st kept for backward
                        "after forward": [g] * 5,
                        "gathered in 3rd unit's backward": [yes, yes, yes, no, no],
                        "after backward": [s] * 5,
                        "after step": [s] * 5}, seen
    # without prefetch: nothing ahead, in the forward or the backward
    for seen in run_on_ranks(_walk, 2, args=(True, False)):
        assert seen["in 2nd unit"] == [s, f, s, s, g], seen
        assert seen["gathered in 3rd unit's backward"] == [no, no, yes, no, no], seen


@pytest.mark.parametrize(("old", "new"), [(UnitState.PREFETCHED, UnitState.BACKWARD),
                                          (UnitState.FORWARD, UnitState.FORWARD),
                                          (UnitState.FORWARD, UnitState.PREFETCHED)])
def test_an_illegal_transition_is_an_internal_error_naming_both_states(
        old: UnitState, new: UnitState) -> None:
    with pytest.raises(RuntimeError, match=f"internal error.*{old.name} -> {new.name}"):
        check_transition("of 1 module(s) Linear", old, new)
