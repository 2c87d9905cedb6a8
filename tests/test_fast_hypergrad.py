"""The hypergradient functions on shard fast weights (tests/fast_hyper.py): every method
equals one process on the whole batch under zero3 at 2, 3 and 4 ranks and hsdp 2 x 2, in
float64 (these are the functions' own parity figures: test_hypergrad.py checks the whole
tensors' path the same way)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fast_hyper
from metadist.testing import run_on_ranks

SHARDED = {"min_unit_params": 20}
# float64: the methods agree with one process to float64 rounding, amplified by the
# central difference (darts) and the solves (neumann, cg): 1e-12 leaves ~100x room
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module")
def want() -> dict[str, torch.Tensor]:
    return run_on_ranks(fast_hyper.on_rank, 1, args=("single",))[0]


@pytest.mark.parametrize(("strategy", "n", "nnodes"), [("zero3", 2, 1), ("zero3", 3, 1),
                                                       ("zero3", 4, 1), ("hsdp", 4, 2)])
def test_hypergradients_on_shards_match_one_process(strategy: str, n: int, nnodes: int,
                                                     want: dict[str, torch.Tensor]) -> None:
    out = run_on_ranks(fast_hyper.on_rank, n, nnodes=nnodes, timeout=300,
                       args=(strategy, SHARDED))
    for rank, got in enumerate(out):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, **TOL,
                                       msg=lambda m, name=name, rank=rank:
                                       f"{strategy} n={n} rank={rank} {name}: {m}")


def _gathered(strategy: str, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The same methods on the gathered path (full_parameters), for the test of the test."""
    import metadist
    from metadist.meta import hypergradient

    s = metadist.strategy(strategy, **options)
    model = fast_hyper.net()
    model, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    w = metadist.world()
    xt, yt, xv, yv = (t.chunk(w.world_size)[w.rank] for t in fast_hyper.data())

    def inner(params: Any, lam: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out = model.functional_forward(params, xt * lam[0].exp())
        return ((out - yt) ** 2).mean() + fast_hyper.DECAY * sum(
            (p * p).sum() for p in params.values())

    def outer(params: Any, lam: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return ((model.functional_forward(params, xv * lam[0].exp()) - yv) ** 2).mean()

    lam = torch.full((fast_hyper.FEATURES,), 0.1, dtype=torch.float64, requires_grad=True)
    return {name: hypergradient(name, outer, inner, model.full_parameters(), (lam,), config,
                                grad_sync=s.sync_grads)[0]
            for name, config in fast_hyper.CONFIGS.items()}


def test_the_gathered_path_agrees(want: dict[str, torch.Tensor]) -> None:
    """The whole-tensor path (full_parameters under zero3) gives the same hypergradients:
    the reference is not an artefact of fast weights."""
    for got in run_on_ranks(_gathered, 2, args=("zero3", SHARDED)):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, **TOL)
