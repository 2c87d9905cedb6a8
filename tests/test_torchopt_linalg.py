"""``torchopt.linalg`` and ``torchopt.linear_solve`` of the drop-in (conjugate gradient on
metadist's own solver, meta.hypergrad.conjugate_gradient) against TorchOpt 0.7.3's, float64."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import peers


def _solves(impl: str) -> list[torch.Tensor]:
    if impl == "torchopt":
        peers.use()
    to = importlib.import_module("torchopt" if impl == "torchopt" else
                                 "metadist.compat.torchopt")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, dtype=torch.float64, generator=g)
    a = a @ a.T + 6 * torch.eye(6, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64, generator=g)
    tree = {"u": b[:4], "v": b[4:]}
    blocks = {"u": a[:4, :4], "v": a[4:, 4:]}

    def mv(x: torch.Tensor) -> torch.Tensor:
        return a @ x

    return [to.linalg.cg(mv, b), to.linalg.cg(blocks, tree)["v"],
            to.linalg.ns(mv, b, alpha=0.05, maxiter=50), to.linalg.ns_inv(a, alpha=0.05,
                                                                          maxiter=20),
            to.linear_solve.solve_cg(ridge=0.1)(mv, b), to.linear_solve.solve_normal_cg()(mv, b),
            to.linear_solve.solve_inv()(mv, b), to.linear_solve.solve_inv(ns=True,
                                                                       alpha=0.05)(mv, b)]


@pytest.fixture(scope="module")
def both() -> tuple[list[Any], list[Any]]:
    return _solves("compat"), peers.run_on(1, _solves, ("torchopt",))[0]


@pytest.mark.parametrize("i", range(8))
def test_same_solutions_as_torchopt(both: tuple[list[Any], list[Any]], i: int) -> None:
    ours, theirs = both
    torch.testing.assert_close(ours[i], theirs[i], rtol=1e-12, atol=1e-12)
