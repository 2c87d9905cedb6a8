"""Meta-learning stays exact across ranks: second-order MAML, a gradient-norm penalty (double
backward through the gradient) and an unrolled hypergradient, each against one process."""

from __future__ import annotations

import pytest
import torch

from meta import (
    hyper_on_rank,
    hyper_reference,
    maml_on_rank,
    maml_reference,
    penalty_on_rank,
    penalty_reference,
)
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

# (strategy, options): zero3/hsdp with tiny units so the models split into several.
STRATEGIES: dict[str, dict[str, object]] = {
    "ddp": {}, "zero1": {}, "zero2": {},
    "zero3": {"min_unit_params": 50}, "hsdp": {"min_unit_params": 50},
}
# (world size, simulated nodes): hsdp shards within 2 nodes and replicates across them.
LAYOUTS = {name: [(n, 1) for n in (1, 2, 3, 4)] for name in STRATEGIES}
LAYOUTS["hsdp"] = [(2, 2), (4, 2)]
CASES = [(name, n, nodes) for name, layouts in LAYOUTS.items() for n, nodes in layouts]


@pytest.fixture(scope="module")
def maml_want() -> dict[bool, dict[str, torch.Tensor]]:
    return {per_task: maml_reference(per_task) for per_task in (False, True)}


@pytest.mark.parametrize("per_task_backward", [False, True])
@pytest.mark.parametrize(("strategy", "n", "nnodes"), CASES)
def test_second_order_maml_matches_single_process(
        strategy: str, n: int, nnodes: int, per_task_backward: bool,
        maml_want: dict[bool, dict[str, torch.Tensor]]) -> None:
    out = run_on_ranks(maml_on_rank, n, nnodes=nnodes, timeout=300,
                       args=(strategy, per_task_backward, STRATEGIES[strategy]))
    for rank, got in enumerate(out):
        assert_tensors_close(got, maml_want[per_task_backward], f"{strategy} n={n} rank={rank}")


@pytest.mark.parametrize(("strategy", "n", "nnodes"), CASES)
def test_gradient_norm_penalty_matches_single_process(strategy: str, n: int,
                                                      nnodes: int) -> None:
    want = penalty_reference()
    out = run_on_ranks(penalty_on_rank, n, nnodes=nnodes, args=(strategy, STRATEGIES[strategy]))
    for rank, got in enumerate(out):
        assert_tensors_close(got, want, f"{strategy} n={n} rank={rank}")


@pytest.mark.parametrize(("strategy", "n", "nnodes"), CASES)
def test_synced_hypergradient_matches_single_process(strategy: str, n: int,
                                                     nnodes: int) -> None:
    params, decay, hypers = hyper_reference()
    out = run_on_ranks(hyper_on_rank, n, nnodes=nnodes, args=(strategy, STRATEGIES[strategy]))
    for rank, (got, got_decay, got_hypers) in enumerate(out):
        assert got_hypers == pytest.approx(hypers, rel=1e-5, abs=1e-7), f"rank {rank}"
        assert got_decay == pytest.approx(decay, rel=1e-6)
        assert_tensors_close(got, params, f"{strategy} n={n} rank={rank}")
