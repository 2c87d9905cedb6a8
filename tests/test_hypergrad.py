"""Hypergradients of a bilevel ridge regression against its closed form, and across ranks
against one process on the whole data.

Inner: theta*(lam) = argmin G,  G = mean_i 1/2 (x_i.theta - y_i)^2 + 1/2 sum_j exp(lam_j) theta_j^2
Outer: F = mean_v 1/2 (x_v.theta - y_v)^2 + 0.01 |lam|^2   (a direct lam term exercises dF/dlam)
Closed form: H = X^T X / n + diag(exp(lam)), theta* = inv(H) X^T y / n and
dF/dlam = 0.02 lam - exp(lam) * theta* * inv(H) dF/dtheta(theta*).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor

import metadist
from metadist.meta import (
    CGConfig,
    DartsConfig,
    HypergradConfig,
    NeumannConfig,
    UnrolledConfig,
    hypergradient,
    sgd,
)
from metadist.testing import run_on_ranks

# Synced across ranks against one process, float64: both sides are computed on the machine
# running the test and differ only in the order the ranks' means are summed. Measured here
# (entries up to 0.62): at most 3.3e-16 for neumann, cg and unrolled, 1.9e-15 for darts,
# whose central difference divides rounding by its step (r / |v|). 1e-12 leaves ~500x for
# another CPU's summation order; the float32 parity tolerances (rtol 1.3e-6 / atol 1e-5)
# let a sync that reduced in float32 pass (errors 1.2e-8 to 5.2e-7).
SYNCED_ATOL = 1e-12
D, N_TRAIN, N_VAL = 5, 24, 12  # divisible by the world sizes 2 and 3
# Eigenvalues of H at LAM lie in [1.16, 2.95] (checked in _spectrum): well conditioned, so
# few iterations reach rounding level. Per-rank Hessians (a third of the data) reach 4.55,
# which ALPHA = 0.4 still handles (alpha * 4.55 < 2), so the naive runs below converge too.
ALPHA, NEUMANN_K = 0.4, 40
ETA, UNROLL_K = 0.5, 40
XI = 0.3
CONFIGS: dict[str, HypergradConfig] = {
    "neumann": NeumannConfig(iterations=NEUMANN_K, alpha=ALPHA),
    "cg": CGConfig(iterations=10, tol=1e-12),
    "unrolled": UnrolledConfig(steps=UNROLL_K, optimizer=sgd(ETA)),
    "darts": DartsConfig(xi=XI, r=0.01),
}


def _data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = x @ w + 0.5 * torch.randn(N_TRAIN, generator=g, dtype=torch.float64)
    xv = torch.randn(N_VAL, D, generator=g, dtype=torch.float64)
    yv = xv @ w + 0.5 * torch.randn(N_VAL, generator=g, dtype=torch.float64)
    return x, y, xv, yv


def _lam() -> Tensor:
    return torch.linspace(0.5, 1.5, D, dtype=torch.float64).log().requires_grad_()


Loss = Callable[[tuple[Tensor, ...], tuple[Tensor, ...]], Tensor]


def _losses(x: Tensor, y: Tensor, xv: Tensor, yv: Tensor) -> tuple[Loss, Loss]:
    def inner(params: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
        (theta,), (lam,) = params, hp
        return 0.5 * ((x @ theta - y) ** 2).mean() + 0.5 * (lam.exp() * theta**2).sum()

    def outer(params: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
        (theta,), (lam,) = params, hp
        return 0.5 * ((xv @ theta - yv) ** 2).mean() + 0.01 * (lam**2).sum()

    return outer, inner


def _hessian(lam: Tensor) -> Tensor:
    x = _data()[0]
    return x.T @ x / N_TRAIN + torch.diag(lam.detach().exp())


def _solution(lam: Tensor) -> Tensor:
    x, y, _, _ = _data()
    return torch.linalg.solve(_hessian(lam), x.T @ y / N_TRAIN)


def _outer_grad(theta: Tensor) -> Tensor:
    _, _, xv, yv = _data()
    return xv.T @ (xv @ theta - yv) / N_VAL


def _closed_form(lam: Tensor) -> Tensor:
    lam = lam.detach()
    theta = _solution(lam)
    return 0.02 * lam - lam.exp() * theta * torch.linalg.solve(_hessian(lam), _outer_grad(theta))


def _start(method: str, lam: Tensor) -> tuple[Tensor, ...]:
    """Implicit methods start at the inner solution, unrolled from zero, DARTS anywhere."""
    if method == "unrolled":
        return (torch.zeros(D, dtype=torch.float64),)
    if method == "darts":
        return (_solution(lam) + 0.3,)
    return (_solution(lam),)


def _spectrum() -> tuple[float, float]:
    eig = torch.linalg.eigvalsh(_hessian(_lam()))
    return eig[0].item(), eig[-1].item()


def test_problem_constants_make_truncation_negligible() -> None:
    low, high = _spectrum()
    assert low > 1.1 and high < 3.0
    # Neumann: error of inv(H) v is inv(H) (I - alpha H)^(K+1) v, rho = max |1 - alpha eig|.
    rho = max(abs(1 - ALPHA * low), abs(1 - ALPHA * high))
    assert rho ** (NEUMANN_K + 1) < 1e-10  # 0.54^41 = 1e-11
    # Unrolled GD from theta_0: theta_K - theta* = (I - eta H)^K (theta_0 - theta*), and its
    # derivative in lam adds K (I - eta H)^(K-1) terms: the error is O(K rho^(K-1)).
    rho = max(abs(1 - ETA * low), abs(1 - ETA * high))
    assert UNROLL_K * rho ** (UNROLL_K - 1) < 1e-10  # 40 * 0.47^39 = 6e-12


def test_implicit_methods_match_closed_form() -> None:
    lam = _lam()
    outer, inner = _losses(*_data())
    want = _closed_form(lam)
    theta = _solution(lam)
    # Neumann's error bound: |M| |inv(H)| rho^(K+1) |dF/dtheta| with M = diag(exp(lam) theta*).
    low, high = _spectrum()
    rho = max(abs(1 - ALPHA * low), abs(1 - ALPHA * high))
    bound = ((lam.exp() * theta).abs().max() / low * rho ** (NEUMANN_K + 1)
             * _outer_grad(theta).norm()).item()
    (got,) = hypergradient("neumann", outer, inner, (theta,), (lam,), CONFIGS["neumann"])
    assert (got - want).abs().max().item() <= bound + 1e-13
    # CG: exact after D = 5 steps in exact arithmetic; it stops at |r| <= 1e-12 |b|, so the
    # error is below |M| |inv(H)| 1e-12 |b| ~ 1e-12 plus float64 rounding.
    (got,) = hypergradient("cg", outer, inner, (theta,), (lam,), CONFIGS["cg"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_unrolled_matches_closed_form() -> None:
    lam = _lam()
    outer, inner = _losses(*_data())
    (got,) = hypergradient("unrolled", outer, inner, _start("unrolled", lam), (lam,),
                           CONFIGS["unrolled"])
    # O(K rho^(K-1)) = 6e-12 times O(1) problem constants (see the constants test).
    torch.testing.assert_close(got, _closed_form(lam), rtol=0, atol=1e-9)


def test_darts_is_the_exact_one_step_derivative() -> None:
    """DARTS differentiates one virtual SGD step: w' = w - xi dG/dw. For this G the mixed term
    d/dlam dG/dw is linear in w, so the central difference is exact and only rounding
    (~1e-16 |dG/dlam| / eps, eps = r / |v|) separates DARTS from the closed form of
    d/dlam F(w'(lam), lam) = 0.02 lam - xi exp(lam) w dF/dw(w')."""
    lam = _lam()
    data = _data()
    outer, inner = _losses(*data)
    (w,) = _start("darts", lam)
    xi = XI
    x, y, _, _ = data
    w_virtual = w - xi * (x.T @ (x @ w - y) / N_TRAIN + lam.detach().exp() * w)
    want = 0.02 * lam.detach() - xi * lam.detach().exp() * w * _outer_grad(w_virtual)
    (got,) = hypergradient("darts", outer, inner, (w,), (lam,), CONFIGS["darts"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    # The same derivative by one unrolled step of sgd(xi), and the first-order variant.
    (one,) = hypergradient("unrolled", outer, inner, (w,), (lam,),
                           UnrolledConfig(steps=1, optimizer=sgd(xi)))
    torch.testing.assert_close(one, want, rtol=0, atol=1e-12)
    (first,) = hypergradient("darts", outer, inner, (w,), (lam,),
                             DartsConfig(xi=xi, first_order=True))
    torch.testing.assert_close(first, 0.02 * lam.detach(), rtol=0, atol=1e-15)


def test_params_may_be_a_dict_and_user_tensors_stay_untouched() -> None:
    lam = _lam()
    x, y, xv, yv = _data()
    theta = _solution(lam).requires_grad_()

    def inner(p: dict[str, Tensor], hp: tuple[Tensor, ...]) -> Tensor:
        t = torch.cat([p["head"], p["tail"]])
        return 0.5 * ((x @ t - y) ** 2).mean() + 0.5 * (hp[0].exp() * t**2).sum()

    def outer(p: dict[str, Tensor], hp: tuple[Tensor, ...]) -> Tensor:
        t = torch.cat([p["head"], p["tail"]])
        return 0.5 * ((xv @ t - yv) ** 2).mean() + 0.01 * (hp[0] ** 2).sum()

    params = {"head": theta[:2], "tail": theta[2:]}
    got = hypergradient("cg", outer, inner, params, lam, CONFIGS["cg"])  # a bare tensor is ok
    torch.testing.assert_close(got[0], _closed_form(lam), rtol=0, atol=1e-10)
    assert theta.grad is None and lam.grad is None


def test_errors_name_the_choices() -> None:
    outer, inner = _losses(*_data())
    lam = _lam()
    with pytest.raises(ValueError, match="choose one of: unrolled, darts, neumann, cg"):
        hypergradient("newton", outer, inner, (_solution(lam),), (lam,))
    with pytest.raises(TypeError, match="takes a CGConfig"):
        hypergradient("cg", outer, inner, (_solution(lam),), (lam,), NeumannConfig())
    with pytest.raises(ValueError, match="requires_grad=True"):
        hypergradient("cg", outer, inner, (_solution(lam),), (lam.detach(),))
    with pytest.raises(ValueError, match="alpha > 0"):
        NeumannConfig(alpha=0.0)

    def concave(p: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
        return -inner(p, hp)

    with pytest.raises(ValueError, match="not positive definite"):
        hypergradient("cg", outer, concave, (_solution(lam),), (lam,))


# ----- across ranks ------------------------------------------------------------------------------
NAIVE = ("neumann", "cg")


@contextmanager
def _reduce_in_float32(enabled: bool) -> Iterator[None]:
    """A sync whose all-reduce runs in float32 (a float64 problem's means rounded to float32):
    the broken path of the test of the test; restored on exit (the ranks are pooled)."""
    from metadist.comm import functional

    reduce_many = functional.all_reduce_many

    def in_float32(tensors: list[Tensor], op: str, *args: object,
                   **kwargs: object) -> list[Tensor]:
        out = reduce_many([t.float() for t in tensors], op, *args, **kwargs)
        return [o.to(t.dtype) for o, t in zip(out, tensors, strict=True)]

    if enabled:
        functional.all_reduce_many = in_float32  # type: ignore[assignment]
    try:
        yield
    finally:
        functional.all_reduce_many = reduce_many  # type: ignore[assignment]


def _hypergrads_on_rank(float32_sync: bool = False) -> dict[str, Tensor]:
    """Each rank holds a contiguous slice of the training and validation data; its losses are
    means over its slice (the regulariser in full: the mean over ranks keeps it once).
    ``float32_sync``: the sync's reduction rounded to float32 (the test of the test)."""
    with _reduce_in_float32(float32_sync):
        return _synced_hypergrads()


def _synced_hypergrads() -> dict[str, Tensor]:
    w = metadist.world()
    x, y, xv, yv = _data()
    per, per_v = N_TRAIN // w.world_size, N_VAL // w.world_size
    mine = slice(w.rank * per, (w.rank + 1) * per)
    mine_v = slice(w.rank * per_v, (w.rank + 1) * per_v)
    outer, inner = _losses(x[mine], y[mine], xv[mine_v], yv[mine_v])
    sync = metadist.strategy("ddp").sync_grads
    lam = _lam()
    out = {}
    for method, config in CONFIGS.items():
        start = _start(method, lam)
        (out[method],) = hypergradient(method, outer, inner, start, (lam,), config,
                                       grad_sync=sync)
        if method in NAIVE:  # this rank's own hypergradient, for the naive average
            (out["naive_" + method],) = hypergradient(method, outer, inner, start, (lam,), config)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_synced_hypergradients_equal_single_process(world_size: int) -> None:
    lam = _lam()
    outer, inner = _losses(*_data())
    want = {m: hypergradient(m, outer, inner, _start(m, lam), (lam,), c)[0]
            for m, c in CONFIGS.items()}
    results = run_on_ranks(_hypergrads_on_rank, world_size)
    for rank, got in enumerate(results):
        for method in CONFIGS:
            torch.testing.assert_close(got[method], want[method], rtol=0, atol=SYNCED_ATOL,
                                       msg=lambda m, method=method, rank=rank:
                                       f"{method} rank {rank}: {m}")
    # Our differentiator: averaging per-rank implicit hypergradients is a different (wrong)
    # number, since mean_r inv(H_r) v_r != inv(H) v. Measured max abs gaps on this problem:
    # 0.036 at world size 2 and 0.043 at 3 (hypergradient entries up to 0.62), against
    # synced results within 3e-16 of the single process.
    for method in NAIVE:
        naive = torch.stack([got["naive_" + method] for got in results]).mean(0)
        gap = (naive - want[method]).abs().max().item()
        assert gap > 1e-3, f"naive {method} average unexpectedly matches ({gap:.2g})"


def test_a_float32_sync_fails_the_synced_check() -> None:
    """The test of the test above: a sync that reduces in float32 is off by far more than
    SYNCED_ATOL for every method, though within the float32 parity tolerances."""
    lam = _lam()
    outer, inner = _losses(*_data())
    want = {m: hypergradient(m, outer, inner, _start(m, lam), (lam,), c)[0]
            for m, c in CONFIGS.items()}
    for got in run_on_ranks(_hypergrads_on_rank, 2, args=(True,)):
        for method in CONFIGS:
            gap = (got[method] - want[method]).abs().max().item()
            assert 1000 * SYNCED_ATOL < gap < 1e-5, (method, gap)
