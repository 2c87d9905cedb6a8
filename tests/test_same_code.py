"""Same code, same result under every strategy: each meta-learning idiom of tests/idioms.py, run
unchanged through every strategy on 1, 2 or 3 ranks, either matches one plain PyTorch process
(fp32 parity tolerances) or raises the documented error. No cell may run and silently differ.

One pool round-trip per (strategy, world size) runs every idiom (cached); each test then checks
one idiom of that cell against EXPECTED.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch

from idioms import IDIOMS, Failure, all_idioms_on_rank, reference
from metadist.testing import run_on_ranks
from parity import assert_tensors_close


@dataclass(frozen=True)
class Raises:
    """The documented error: its type, and patterns its message must all match."""

    type: str
    patterns: tuple[str, ...]


PARITY = "parity"
SHARDING = ("zero3", "fsdp", "hsdp")
REPLICATING = ("single", "ddp", "zero1", "zero2")
STRATEGIES = REPLICATING + SHARDING


def _table(sharded: str | Raises = PARITY) -> dict[str, str | Raises]:
    return {**dict.fromkeys(REPLICATING, PARITY), **dict.fromkeys(SHARDING, sharded)}


EXPECTED: dict[str, dict[str, str | Raises]] = {
    # Its first inner step differentiates with respect to the parameters' slices: error (1) of
    # docs/meta-learning.md; a later step's swapped-in fast shards would meet error (2)
    # (fsdp here keeps units gathered, reshard_after_forward=False: the swapped-in
    # parameters are read whole there, and the idiom equals one process)
    "maml_functional_call": {**_table(Raises("RuntimeError", (r"autograd\.grad",
                                                              r"slice of each"))),
                             "fsdp": PARITY},
    "maml_functional_call_full": _table(),
    "maml_full_parameters": _table(),
    "maml_module_clone": _table(),
    "maml_module_clone_adam": _table(),
    "maml_module_clone_adamw": _table(),
    # Stepping the wrapped model in place would step a gathered copy, not the shards.
    "maml_meta_sgd_in_place": _table(Raises("ValueError", (r"holds parameter shards",
                                                           r"module_clone\(model, by='copy'\)"))),
    "maml_torch_func": _table(),
    # autograd.grad with respect to shards is not the gradient of this rank's loss: refused.
    "penalty_usual": _table(Raises("RuntimeError", (r"autograd\.grad", r"shard"))),
    "penalty_local_portable": _table(),
    "penalty_global": _table(),
    "unrolled_hypergradient": _table(),
}
assert EXPECTED.keys() == IDIOMS.keys()

# Tiny buckets / units so the small models split into several owners and units.
OPTIONS: dict[str, dict[str, Any]] = {
    "single": {}, "ddp": {}, "zero1": {},
    "zero2": {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0005},
    "zero3": {"min_unit_params": 10},
    "fsdp": {"min_unit_params": 1, "reshard_after_forward": False, "prefetch": False},
    "hsdp": {"min_unit_params": 10},
}
# hsdp as tests/test_zero.py runs it: 2 ranks = 2 nodes x 1 (replicate only), 3 ranks = 1 node
# x 3 (shard only); 3 ranks have no 2-D layout.
NODES = {("hsdp", 2): 2}
CELLS = [("single", 1)] + [(s, n) for s in STRATEGIES[1:] for n in (2, 3)]
CASES = [(s, n, idiom) for s, n in CELLS for idiom in IDIOMS]


@cache
def _cell(strategy: str, n: int) -> tuple[dict[str, Any], ...]:
    """Every idiom's result (or Failure) on every rank of one (strategy, world size)."""
    return tuple(run_on_ranks(all_idioms_on_rank, n, nnodes=NODES.get((strategy, n), 1),
                              timeout=600, args=(strategy, OPTIONS[strategy])))


@cache
def _reference(idiom: str, n: int) -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend with the ranks for cores
    try:
        return reference(idiom, n)
    finally:
        torch.set_num_threads(threads)


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert_tensors_close(got, want, where)
        return
    (params, decay, hypers), (want_params, want_decay, want_hypers) = got, want  # hypergradient
    assert hypers == pytest.approx(want_hypers, rel=1e-5, abs=1e-7), f"{where} hypergradients"
    assert decay == pytest.approx(want_decay, rel=1e-6), f"{where} decay"
    assert_tensors_close(params, want_params, where)


@pytest.mark.parametrize(("strategy", "n", "idiom"), CASES)
def test_idiom_matches_one_process_or_raises_the_documented_error(strategy: str, n: int,
                                                                  idiom: str) -> None:
    expected = EXPECTED[idiom][strategy]
    for rank, out in enumerate(_cell(strategy, n)):
        got, where = out[idiom], f"{idiom} under {strategy} n={n} rank={rank}"
        if isinstance(expected, Raises):
            assert isinstance(got, Failure), f"{where}: ran, expected {expected.type}"
            assert got.type == expected.type, f"{where}: {got}"
            for pattern in expected.patterns:
                assert re.search(pattern, got.message), f"{where}: {pattern!r} not in {got}"
        else:
            assert not isinstance(got, Failure), f"{where}: raised {got}"
            _assert_same(got, _reference(idiom, n), where)


def test_bodies_are_checked_against_distinct_references() -> None:
    """A guard on the harness itself: a per-rank penalty on 2 ranks is not the global one, so
    the penalty rows would catch a strategy that computed the wrong one."""
    local, global_ = _reference("penalty_usual", 2), _reference("penalty_global", 2)
    assert any(not torch.allclose(local[k], global_[k], rtol=1e-4, atol=1e-4) for k in local)
