"""BatchNorm in meta-learning: each task normalised by its own statistics, and the running
statistics updated as one process updates them (strategies/batchnorm/running_stats.py).

Reproduction (2 ranks, the programs of tests/batchnorm_tasks.py on Omniglot's shapes): before,
learn2learn's MAML, its MetaSGD, higher and ``full_parameters()`` + ``functional_forward``
under ``sync_batchnorm=True`` pooled rank 0's task with rank 1's and trained 1e-2 to 1e-1 away
from one process, silently; under ``sync_batchnorm=False`` they stopped in autograd ("modified
by an inplace operation": the buffer broadcast wrote into running statistics a double
backward saved); with ``broadcast_buffers=False`` the running statistics differed from one
process's and between ranks; ``module_clone(by="copy")`` never updated them, under ``single``
too. Now every cell below equals one process, parameters and buffers (num_batches_tracked
included), every rank bit for bit the same, or stops with a clear error:

* a per-rank task (a copy of the model, explicit or adapted weights) normalises by its own
  batch whatever ``sync_batchnorm`` says, and is never asked;
* ANIL runs the set-up model's own forward on each task: ``sync_batchnorm=False`` (each rank's
  batch a batch of its own) is one process's result, unsaid it asks;
* zero3/hsdp: the portable forms equal one process, the peers' clones stop naming the library.

The one-process reference runs every task of a meta-step in order; a rank runs its contiguous
slice, so "rank order" is the meta-batch's order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import batchnorm_tasks as bt
import peers
from parity import assert_tensors_close

JOB_TIMEOUT = 300.0
PORTABLE = ("full_parameters", "module_clone")
PER_TASK = ("learn2learn MAML", "learn2learn MetaSGD", "higher", *PORTABLE)
# (strategy, ranks, simulated nodes, sync_batchnorm): both choices at 2 and 3 ranks, and
# unsaid, under each replicated strategy
CELLS = [("single", 1, 1, None), ("ddp", 2, 1, None), ("ddp", 2, 1, True), ("ddp", 3, 1, False),
         ("zero1", 2, 1, False), ("zero1", 3, 1, True), ("zero2", 2, 1, True),
         ("zero2", 3, 1, False)]
SHARDED = [("zero3", 2, 1, None), ("hsdp", 2, 2, True)]
OPTIONS = {"zero3": {"min_unit_params": 50}, "hsdp": {"min_unit_params": 50}}


@pytest.fixture(scope="module")
def ranks() -> Iterator[Callable[[int, int], peers.Reopening]]:
    with peers.layouts(JOB_TIMEOUT) as get:
        yield get


@pytest.fixture(scope="module")
def want() -> dict[str, bt.State]:
    with peers.pool(1, JOB_TIMEOUT) as run:
        out: dict[str, bt.State] = run(bt.all_one_process, bt.PROGRAMS)[0]
        return out


def _check_equal(got: list[dict[str, Any]], want: dict[str, bt.State], names: tuple[str, ...],
                 where: str) -> None:
    for name in names:
        for rank, states in enumerate(got):
            state = states[name]
            assert not isinstance(state, str), f"{where} {name} rank {rank}: {state}"
            assert_tensors_close(state, want[name], f"{where} {name} rank {rank}")
            for key, value in state.items():  # the ranks agree, buffers included
                assert torch.equal(value, got[0][name][key]), \
                    f"{where} {name}: {key} differs between rank 0 and rank {rank}"


@pytest.mark.parametrize(("strategy", "n", "nodes", "said"), CELLS)
def test_meta_learning_with_batchnorm_equals_one_process(
        ranks: Callable[[int, int], peers.Reopening], want: dict[str, bt.State],
        strategy: str, n: int, nodes: int, said: bool | None) -> None:
    where = f"{strategy} on {n} ranks, sync_batchnorm={said}"
    anil = ("learn2learn ANIL",)
    got = ranks(n, nodes).run(bt.all_on_rank, strategy, {"sync_batchnorm": said},
                              PER_TASK + anil)
    _check_equal(got, want, PER_TASK, where)
    if said is True:  # the model's own forward on all ranks' batches together, as said
        return
    if said is None and n > 1:  # the model's own forward: only the program knows
        for states in got:
            message = states[anil[0]]
            assert isinstance(message, str), f"{where}: ANIL ran unasked"
            assert "sync_batchnorm=False" in message and "a task" in message, message
        return
    _check_equal(got, want, anil, where)


@pytest.mark.parametrize(("strategy", "n", "nodes", "said"), SHARDED)
def test_sharded_strategies_equal_or_name_the_library(
        ranks: Callable[[int, int], peers.Reopening], want: dict[str, bt.State],
        strategy: str, n: int, nodes: int, said: bool | None) -> None:
    where = f"{strategy} on {n} ranks"
    options = {**OPTIONS[strategy], "sync_batchnorm": said}
    got = ranks(n, nodes).run(bt.all_on_rank, strategy, options, PER_TASK)
    _check_equal(got, want, PORTABLE, where)
    for name in ("learn2learn MAML", "learn2learn MetaSGD", "higher"):
        library = "learn2learn" if name.startswith("learn2learn") else r"\bhigher's"
        for states in got:
            message = states[name]
            assert isinstance(message, str), f"{where} {name}: ran on shards"
            assert re.search(library, message) and "full_parameters" in message, message


def test_references_normalise_each_task_and_update_running_statistics(
        want: dict[str, bt.State]) -> None:
    """Guards on the references: every idiom computes the same second-order MAML (higher's
    patched module keeps its own buffers, so only its parameters are compared), and the
    running statistics moved."""
    base = want["full_parameters"]
    for name in PER_TASK:
        state = {k.removeprefix("module."): v for k, v in want[name].items()
                 if not k.startswith("lrs")}
        keys = [k for k in base if name != "higher" or ("running" not in k and "num" not in k)]
        if name == "learn2learn MetaSGD":  # trained learning rates: another program
            continue
        assert_tensors_close({k: state[k] for k in keys}, {k: base[k] for k in keys}, name)
    fresh = bt.omniglot_net().state_dict()
    assert not torch.allclose(base["0.1.running_mean"], fresh["0.1.running_mean"])
    assert int(base["0.1.num_batches_tracked"]) == bt.OUTER_STEPS * bt.TASKS * 2
