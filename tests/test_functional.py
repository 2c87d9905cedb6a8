"""Differentiable collectives against a single-process autograd computation of the same
mathematics: first order and second order (double backward), both gradient conventions."""

from __future__ import annotations

import pytest
import torch

import metadist
from metadist.comm import functional as F
from metadist.testing import run_on_ranks

OPS = ["all_reduce_sum", "all_reduce_mean", "all_gather", "reduce_scatter_sum",
       "reduce_scatter_mean", "broadcast"]


Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _randn(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _inputs(rank: int, n: int, replicated: bool) -> Triple:
    """Input x, objective weights w and second-order direction v of one rank.

    w and v are rank-specific for per_rank objectives and shared for a replicated one.
    """
    shared = 0 if replicated else rank
    return _randn(2 * n, rank), _randn(2 * n * n, 100 + shared), _randn(2 * n, 200 + shared)


def _apply(op: str, x: torch.Tensor, convention: str) -> torch.Tensor:
    match op:
        case "all_reduce_sum":
            return F.all_reduce(x, "sum", convention=convention)  # type: ignore[arg-type]
        case "all_reduce_mean":
            return F.all_reduce(x, "mean", convention=convention)  # type: ignore[arg-type]
        case "all_gather":
            return F.all_gather(x, convention=convention)  # type: ignore[arg-type]
        case "reduce_scatter_sum":
            return F.reduce_scatter(x, "sum")
        case "reduce_scatter_mean":
            return F.reduce_scatter(x, "mean")
        case "broadcast":
            last = metadist.world().world_size - 1
            return F.broadcast(x, src=last, convention=convention)  # type: ignore[arg-type]
    raise AssertionError(op)


def _reference(op: str, xs: list[torch.Tensor], r: int) -> torch.Tensor:
    """What rank r's output is, written as plain single-process tensor algebra."""
    n = len(xs)
    total = torch.stack(xs).sum(0)
    m = xs[0].shape[0] // n
    match op:
        case "all_reduce_sum":
            return total
        case "all_reduce_mean":
            return total / n
        case "all_gather":
            return torch.cat(xs)
        case "reduce_scatter_sum":
            return total[r * m:(r + 1) * m]
        case "reduce_scatter_mean":
            return total[r * m:(r + 1) * m] / n
        case "broadcast":
            return xs[n - 1]
    raise AssertionError(op)


def _loss(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.sin(y) * w[: y.shape[0]]).sum() + (y**3 * w[: y.shape[0]]).sum() / 7


def _distributed(op: str, convention: str) -> tuple[torch.Tensor, torch.Tensor]:
    w_ = metadist.world()
    x, w, v = _inputs(w_.rank, w_.world_size, convention == "replicated")
    x.requires_grad_(True)
    loss = _loss(_apply(op, x, convention), w)
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (h,) = torch.autograd.grad((g * v).sum(), x)
    return g.detach(), h


def _single_process(op: str, n: int,
                    convention: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    replicated = convention == "replicated"
    triples = [_inputs(r, n, replicated) for r in range(n)]
    xs = [x.clone().requires_grad_(True) for x, _, _ in triples]
    if replicated:
        # One objective shared by every rank, evaluated once (rank 0's view of the output).
        objective = _loss(_reference(op, xs, 0), triples[0][1])
    else:
        objective = sum(_loss(_reference(op, xs, r), triples[r][1]) for r in range(n))
    grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(
        torch.autograd.grad(objective, xs, create_graph=True, allow_unused=True), xs, strict=True)]
    if replicated:
        # Each rank differentiates its own g_r . v (v shared) with respect to its own input:
        # the objective is every rank's, so nothing of the other ranks' terms comes back.
        hess = [_partial((g * v).sum(), x) for g, x, (_, _, v) in zip(grads, xs, triples,
                                                                       strict=True)]
    else:  # the per-rank objectives' sum, differentiated with respect to every rank's input
        second = sum((g * v).sum() for g, (_, _, v) in zip(grads, triples, strict=True))
        hess = [_partial(second, x) for x in xs]
    return [g.detach() for g in grads], hess


def _partial(scalar: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d scalar / d x, zero where the scalar does not depend on x."""
    if not scalar.requires_grad:
        return torch.zeros_like(x)
    (h,) = torch.autograd.grad(scalar, x, retain_graph=True, allow_unused=True)
    return h if h is not None else torch.zeros_like(x)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("op", OPS)
def test_per_rank_convention_first_and_second_order(op: str, n: int) -> None:
    got = run_on_ranks(_distributed, n, args=(op, "per_rank"))
    grads, hess = _single_process(op, n, "per_rank")
    for r, (g, h) in enumerate(got):
        torch.testing.assert_close(g, grads[r], msg=lambda m, r=r: f"grad rank {r}: {m}")
        torch.testing.assert_close(h, hess[r], msg=lambda m, r=r: f"second order rank {r}: {m}")


@pytest.mark.parametrize("n", [2, 3])
# Ops whose output is the same on every rank, so a shared objective is meaningful.
@pytest.mark.parametrize("op", ["all_reduce_sum", "all_reduce_mean", "all_gather", "broadcast"])
def test_replicated_convention_first_and_second_order(op: str, n: int) -> None:
    got = run_on_ranks(_distributed, n, args=(op, "replicated"))
    grads, hess = _single_process(op, n, "replicated")
    for r, (g, h) in enumerate(got):
        torch.testing.assert_close(g, grads[r], msg=lambda m, r=r: f"grad rank {r}: {m}")
        torch.testing.assert_close(h, hess[r], msg=lambda m, r=r: f"second order rank {r}: {m}")


def _fused_sync() -> tuple[torch.Tensor, torch.Tensor]:
    r = metadist.world().rank
    a = torch.full((3,), r + 1.0, dtype=torch.float64, requires_grad=True)
    b = torch.full((2, 2), 2.0 * r, dtype=torch.float64, requires_grad=True)
    ya, yb = F.all_reduce_many([a, b], "mean")
    ((ya**2).sum() * (r + 1) + yb.sum()).backward()
    return a.grad, b.grad  # type: ignore[return-value]


def test_all_reduce_many_is_differentiable() -> None:
    n = 3
    out = run_on_ranks(_fused_sync, n)
    mean_a = sum(r + 1.0 for r in range(n)) / n
    weight = sum(r + 1.0 for r in range(n))
    for ga, gb in out:
        # d/da_r sum_s (s+1) * |mean a|^2 = 2 * mean_a * weight / n per element
        expected = torch.full((3,), 2 * mean_a * weight / n, dtype=torch.float64)
        torch.testing.assert_close(ga, expected)
        torch.testing.assert_close(gb, torch.full((2, 2), 1.0, dtype=torch.float64))


def test_bad_convention_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="per_rank, replicated"):
        F.all_gather(torch.ones(1), convention="mirror")  # type: ignore[arg-type]
