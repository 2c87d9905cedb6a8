"""Directional hypergradients (sama, reinforce, adam_scale) against exact derivatives, and the
engine's multi-level hypergradients against the chain rule, in one process and across ranks.

The three-level problem (float64; x, s, y are each level's data, A, B, C fixed matrices):
  low  theta1: G1 = 1/2 |theta1|^2 - mean_i (x_i * A lam) . theta1          (Hessian I)
  mid  theta2: G2 = mean_i 1/2 sum_j s_ij (theta2 - B theta1 - C lam)_j^2    (Hessian diag(s))
  top  lam:    F  = mean_i 1/2 |theta2 - y_i|^2 + KAPPA/2 |lam|^2            (a direct term)
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Normal
from torch.func import hessian, jacrev
from torch.utils.data import DataLoader, TensorDataset

import metadist
from metadist.meta import (
    CGConfig,
    Engine,
    EngineConfig,
    NeumannConfig,
    Problem,
    ProblemConfig,
    hypergradient,
)
from metadist.meta.directional import ReinforceConfig, SamaConfig, adam_scale, sama
from metadist.strategies.fast_weights import FastWeights
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

F64 = torch.float64
ZERO3 = {"min_unit_params": 1}
BATCH, ITERS = 12, 10  # global batch of every level, divisible by 2 and 3


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ----- sama --------------------------------------------------------------------------------
def _ridge() -> tuple[Any, Any, Tensor, tuple[Tensor, Tensor]]:
    """G is quadratic in theta, so dG/dhp is at most quadratic in theta and the central
    difference of sama is exact up to rounding (~1e-16 |dG/dhp| / eps)."""
    x, y, xv, yv, w = (_randn(16, 4, seed=0), _randn(16, seed=1), _randn(8, 4, seed=2),
                       _randn(8, seed=3), _randn(4, 3, seed=4))

    def inner(p: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
        (t,), (lam, mu) = p, hp
        return (0.5 * ((x @ t - y) ** 2).mean() + 0.5 * (lam.exp() * t**2).sum()
                + t @ (w @ mu.sin()) + mu.cos().sum())

    def outer(p: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
        (t,), (lam, mu) = p, hp
        return 0.5 * ((xv @ t - yv) ** 2).mean() + 0.01 * (lam**2).sum() + 0.1 * (mu**3).sum()

    hp = (torch.linspace(-0.5, 0.5, 4, dtype=F64).requires_grad_(),
          torch.tensor([0.3, -0.2, 0.7], dtype=F64, requires_grad=True))
    return outer, inner, _randn(4, seed=5), hp


def test_sama_is_gf_minus_mixed_product_of_the_preconditioned_direction() -> None:
    outer, inner, theta, hp = _ridge()
    t = theta.clone().requires_grad_()  # exact: gF_hp - M.(P v), M.w = d/dhp (dG/dtheta . w)
    v, *direct = torch.autograd.grad(outer((t,), hp), [t, *hp])
    (g,) = torch.autograd.grad(inner((t,), hp), t, create_graph=True)
    p = torch.tensor([0.5, 2.0, 0.1, 1.3], dtype=F64)  # P = diag(p), shaped like params
    cases = [(SamaConfig(r=1.0), torch.ones(4, dtype=F64)),  # the radius only moves rounding
             (SamaConfig(r=0.05), torch.ones(4, dtype=F64)), (SamaConfig(0.5, (p,)), p)]
    results = []
    for config, scale in cases:
        mixed = torch.autograd.grad(g @ (scale * v), hp, retain_graph=True)
        got = hypergradient("sama", outer, inner, (theta,), hp, config)
        for a, d, m in zip(got, direct, mixed, strict=True):
            torch.testing.assert_close(a, d - m, rtol=1e-10, atol=1e-12)
        results.append(got[0])
    assert (results[2] - results[0]).abs().max() > 1e-2  # P really changes the answer here
    assert theta.grad is None and all(h.grad is None for h in hp)


# ----- adam_scale --------------------------------------------------------------------------
@pytest.mark.parametrize("kind, betas, decay", [
    ("adam", (0.8, 0.95), 0.0), ("adam", (0.0, 0.99), 0.0), ("adamw", (0.9, 0.999), 0.1)])
def test_adam_scale_is_the_derivative_of_the_uncorrected_adam_update(
        kind: str, betas: tuple[float, float], decay: float) -> None:
    p = nn.Parameter(_randn(7, seed=0))
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    opt = cls([p], lr=0.03, betas=betas, eps=1e-14, weight_decay=decay)
    grads = [_randn(7, seed=s) * 0.1 for s in (1, 2, 3)]
    for g in grads[:-1]:
        p.grad = g.clone()
        opt.step()
    state = opt.state[p]
    m_old, v_old, p_old = state["exp_avg"].clone(), state["exp_avg_sq"].clone(), p.detach() + 0
    p.grad = grads[-1].clone()
    opt.step()
    state["last_grad"] = grads[-1].clone()  # what the engine records after a sama step
    group = opt.param_groups[0]
    got = adam_scale(group, state)
    # u(g) = m / (sqrt(v) + eps) with the state update in g; u_j depends on g_j alone, so the
    # gradient of sum(u) is the diagonal of du/dg.
    b1, b2 = betas
    g = grads[-1].clone().requires_grad_()
    seen = g + decay * p_old if kind == "adam" else g  # Adam's L2 term joins the gradient
    m, v = b1 * m_old + (1 - b1) * seen, b2 * v_old + (1 - b2) * seen * seen
    (want,) = torch.autograd.grad((m / (v.sqrt() + group["eps"])).sum(), g)
    torch.testing.assert_close(got, want * group["lr"], rtol=1e-6, atol=0)


# ----- reinforce ---------------------------------------------------------------------------
def _policy(noise: Tensor) -> tuple[Any, Any]:
    """z_i = mu + n_i ~ N(mu, I), per-sample inner loss |theta - z_i|^2, outer |theta - c|^2.
    E[G] = |theta - mu|^2 + dim, so M = d2 E[G] / dtheta dmu = -2 I, v = 2 (theta - c), and
    the response is -xi M.v = 2 xi v (no direct term)."""
    c = torch.tensor([-0.5, 0.9], dtype=F64)

    def inner(p: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> dict[str, Tensor]:
        (t,), (mu,) = p, hp
        z = mu.detach() + noise  # the same samples in every call
        return {"losses": ((t - z) ** 2).sum(1), "log_prob": Normal(mu, 1.0).log_prob(z).sum(1)}

    def outer(p: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
        return ((p[0] - c) ** 2).sum()

    return outer, inner


def test_reinforce_matches_the_gaussian_policy_closed_form() -> None:
    xi, n = 0.5, 200_000
    mu = torch.tensor([0.3, -0.7], dtype=F64, requires_grad=True)
    theta = torch.tensor([1.1, 0.4], dtype=F64)
    c = torch.tensor([-0.5, 0.9], dtype=F64)
    v, a = 2 * (theta - c), (theta - mu).detach()
    want = 2 * xi * v
    # Each sample's term of the estimate is -xi d_i dlogp_i/dmu_j = -2 xi (A - v.n_i) n_ij with
    # A = v.(theta - mu); its variance is 4 xi^2 (A^2 + |v|^2 + v_j^2) (Gaussian moments), so
    # the standard error of a mean over n samples is the square root of that over n.
    def se(samples: int) -> Tensor:
        return 2 * xi * ((v @ a) ** 2 + v @ v + v**2).sqrt() / math.sqrt(samples)

    noise = _randn(n, 2, seed=7)
    outer, inner = _policy(noise)
    (got,) = hypergradient("reinforce", outer, inner, (theta,), (mu,),
                           ReinforceConfig(xi=xi, r=0.01))
    assert ((got - want).abs() <= 4.5 * se(n)).all(), (got, want, se(n))
    # ... and it is exactly the sample mean of those terms (G is quadratic in theta)
    z = mu.detach() + noise
    terms = -xi * (2 * ((theta - z) @ v))[:, None] * (z - mu.detach())
    torch.testing.assert_close(got, terms.mean(0), rtol=1e-9, atol=1e-12)
    # Unbiased: the mean over 16 independent seeds converges to the closed form, and their
    # spread is the predicted standard error (a sample std of 16 values: within 0.5x-1.6x).
    runs = torch.stack([hypergradient("reinforce", *_policy(_randn(5000, 2, seed=100 + s)),
                                      (theta,), (mu,), ReinforceConfig(xi=xi))[0]
                        for s in range(16)])
    assert ((runs.mean(0) - want).abs() <= 4.5 * se(16 * 5000)).all()
    ratio = runs.std(0) / se(5000)
    assert ((ratio > 0.5) & (ratio < 1.6)).all(), ratio


# ----- the three-level engine ----------------------------------------------------------------
DL, D1, D2, KAPPA = 2, 3, 3, 0.1
MAT_A, MAT_B, MAT_C = _randn(D1, DL, seed=10), _randn(D2, D1, seed=11), _randn(D2, DL, seed=12)


def g1(t1: Tensor, lam: Tensor, x: Tensor) -> Tensor:
    return 0.5 * (t1**2).sum() - ((x * (MAT_A @ lam)) @ t1).mean()


def g2(t2: Tensor, t1: Tensor, lam: Tensor, s: Tensor) -> Tensor:
    return 0.5 * (s * (t2 - MAT_B @ t1 - MAT_C @ lam) ** 2).sum(1).mean()


def f(t2: Tensor, lam: Tensor, y: Tensor) -> Tensor:
    return 0.5 * ((t2 - y) ** 2).sum(1).mean() + 0.5 * KAPPA * (lam**2).sum()


class Vec(nn.Module):
    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        self.p = nn.Parameter(_randn(dim, seed=seed))

    def forward(self) -> Tensor:
        return self.p


class Level(Problem):
    def training_step(self, batch: Any) -> Tensor:
        if self.name == "low":
            return g1(self(), self.top(), batch[0])
        if self.name == "mid":
            return g2(self(), self.low(), self.top(), batch[0])
        return f(self.mid(), self(), batch[0])


class Recording(Engine):
    """Records, at every hypergradient, each problem's parameters and batch and the result."""

    def _hypergradient(self, upper: Problem) -> dict[str, Tensor] | FastWeights:
        grads = super()._hypergradient(upper)
        state = {n: (p.params(clone=True)["p"], p.batch[0].clone())
                 for n, p in self.problems.items()}
        # zero3/hsdp: the gradient of this rank's shard pieces; whole (a collective) to record
        whole = grads.full() if isinstance(grads, FastWeights) else grads
        self.__dict__.setdefault("records", []).append((state, whole["p"].detach().clone()))
        return grads


def _loader(seed: int, dim: int, positive: bool = False) -> DataLoader[Any]:
    data = _randn(3 * BATCH, dim, seed=seed)
    data = 0.5 + torch.sigmoid(data) if positive else data  # mid's weights s in (0.5, 1.5)
    return DataLoader(TensorDataset(data), batch_size=BATCH // metadist.init().world_size,
                      shuffle=True)


def three_levels(strategy: str = "single", options: dict[str, Any] | None = None,
                 lowers: tuple[str, ...] = ("low",), **deps: Any) -> Recording:
    """low: SGD lr 1 on a unit Hessian lands exactly on its argmin; neumann(K=0, alpha=1) is
    then exact. mid: SGD lr 0.5, cg with dim iterations and tol 0 (exact for diag(s))."""
    def make(name: str, dim: int, opt: Any, seed: int, config: ProblemConfig | None,
             data: DataLoader[Any]) -> Problem:
        m = Vec(dim, seed)
        return Level(name, m, opt(m.parameters()), train_data_loader=data, config=config)

    low = make("low", D1, lambda ps: torch.optim.SGD(ps, lr=1.0), 1, ProblemConfig(
        method="neumann", hypergrad=NeumannConfig(iterations=0, alpha=1.0)), _loader(21, D1))
    mid = make("mid", D2, lambda ps: torch.optim.SGD(ps, lr=0.5), 2, ProblemConfig(
        method="cg", hypergrad=CGConfig(iterations=D2, tol=0.0)), _loader(22, D2, True))
    top = make("top", DL, lambda ps: torch.optim.Adam(ps, lr=0.05), 3, None, _loader(23, D2))
    return Recording([low, mid, top], EngineConfig(strategy=strategy, train_iters=ITERS,
                                                   strategy_options=options or {}),
                     deps or {"u2l": {"top": list(lowers)},
                              "l2u": {"low": ["mid"], "mid": ["top"]}})


def chain_rule(state: dict[str, tuple[Tensor, Tensor]], through_mid: bool) -> Tensor:
    """dF/dlam + (J2 J1 [+ J2_lam])^T dF/dtheta2 with each response Jacobian by the implicit
    function theorem at the current iterates, J = -inv(d2G/dtheta2) d2G/dtheta dhp, all by
    torch.func on the plain loss functions."""
    (t1, x), (t2, s), (lam, y) = state["low"], state["mid"], state["top"]

    def response(g: Any, theta: Tensor, hp: Tensor, *rest: Tensor) -> Tensor:
        h = hessian(g, argnums=0)(theta, hp, *rest)
        mixed = jacrev(jacrev(g, argnums=0), argnums=1)(theta, hp, *rest)
        out: Tensor = -torch.linalg.solve(h, mixed)
        return out

    j1 = response(g1, t1, lam, x)
    j2 = response(g2, t2, t1, lam, s)
    j2_lam = response(lambda a, c, b, d: g2(a, b, c, d), t2, lam, t1, s)
    total = j2 @ j1 + (j2_lam if through_mid else 0)
    df_t2, df_lam = jacrev(f, argnums=(0, 1))(t2, lam, y)
    out: Tensor = df_lam + total.T @ df_t2
    return out


# ("low",) and ("low", "mid") reproduce a bug: dF/dlam was dropped when the first path
# started with a multi-hop route ([top, mid, low, top]).
@pytest.mark.parametrize("lowers", [("low",), ("mid", "low"), ("low", "mid")])
def test_three_level_hypergradient_is_the_chain_rule(lowers: tuple[str, ...]) -> None:
    engine = three_levels(lowers=lowers)
    want_paths = [{"low": ["top", "mid", "low", "top"], "mid": ["top", "mid", "top"]}[lower]
                  for lower in lowers]  # one per u2l lower, in the order given
    assert engine.paths == {"low": [], "mid": [], "top": want_paths}
    engine.run()
    records = engine.__dict__["records"]
    assert len(records) == ITERS
    # low sits exactly on its argmin (so the implicit function theorem is exact there)
    argmin = torch.stack([st["low"][1].mean(0) * (MAT_A @ st["top"][0]) for st, _ in records])
    torch.testing.assert_close(torch.stack([st["low"][0] for st, _ in records]), argmin,
                               rtol=1e-12, atol=1e-14)
    want = torch.stack([chain_rule(st, "mid" in lowers) for st, _ in records])
    # rows are iterations: a mismatch report's index (i, j) names the iteration
    torch.testing.assert_close(torch.stack([g for _, g in records]), want, rtol=1e-10,
                               atol=1e-12)


def test_u2l_link_without_l2u_route_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"links 'top' to 'low', but no .* from 'low' up to "
                                         r"'top'"):
        three_levels(u2l={"top": ["low"]}, l2u={"low": ["mid"]})


# ----- across ranks ------------------------------------------------------------------------
class Ridge(Problem):
    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        if self.name == "hyper":
            loss: Tensor = 0.5 * ((self.inner(x) - y) ** 2).mean() + 0.01 * (self() ** 2).sum()
            return loss
        w = self.parameters_dict()["weight"].reshape(-1)
        loss = 0.5 * ((self(x) - y) ** 2).mean() + 0.5 * (self.hyper().exp() * w**2).sum()
        return loss


def sama_bilevel(strategy: str = "single", options: dict[str, Any] | None = None,
                 engine_class: type[Engine] = Engine) -> Engine:
    """Ridge regression with per-feature decays exp(lam); the lower level trains with Adam
    and its upper level's hypergradient is sama's, preconditioned by Adam's state."""
    x, w = _randn(6 * BATCH, 4, seed=30), _randn(4, 1, seed=31)
    y = x @ w + 0.5 * _randn(6 * BATCH, 1, seed=32)
    loaders = [DataLoader(TensorDataset(x[i::2], y[i::2]), shuffle=True,
                          batch_size=BATCH // metadist.init().world_size) for i in (0, 1)]
    torch.manual_seed(1)
    linear, decay = nn.Linear(4, 1).double(), Vec(4, 33)
    lower = Ridge("inner", linear, torch.optim.Adam(linear.parameters(), lr=0.05),
                  train_data_loader=loaders[0],
                  config=ProblemConfig(method="sama", hypergrad=SamaConfig(r=0.1)))
    upper = Ridge("hyper", decay, torch.optim.Adam(decay.parameters(), lr=0.05),
                  train_data_loader=loaders[1])
    return engine_class([lower, upper], EngineConfig(strategy=strategy, train_iters=ITERS,
                                                     strategy_options=options or {}),
                        {"u2l": {upper: [lower]}, "l2u": {lower: [upper]}})


class SamaCheck(Engine):
    """Keeps the gradients each inner Adam step used, and compares every hypergradient with
    sama() on plain loss functions, P = adam_scale of that step (times its lr)."""

    def _optimizer_step(self, p: Problem) -> None:
        if p.name == "inner":
            self.__dict__["used"] = [t.grad.clone() for t in p.optimizer.param_groups[0]["params"]]
        super()._optimizer_step(p)

    def _hypergradient(self, upper: Problem) -> dict[str, Tensor]:
        got = super()._hypergradient(upper)["p"]
        inner = self.problems["inner"]
        (x, y), (xv, yv) = inner.batch, upper.batch
        group = inner.optimizer.param_groups[0]
        scale = tuple(adam_scale(group, {**inner.optimizer.state[t], "last_grad": g})
                      for t, g in zip(group["params"], self.__dict__["used"], strict=True))

        def mse(wb: tuple[Tensor, ...], x: Tensor, y: Tensor) -> Tensor:
            return 0.5 * ((x @ wb[0].T + wb[1] - y) ** 2).mean()

        def g_fn(wb: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
            return mse(wb, x, y) + 0.5 * (hp[0].exp() * wb[0].reshape(-1) ** 2).sum()

        def f_fn(wb: tuple[Tensor, ...], hp: tuple[Tensor, ...]) -> Tensor:
            return mse(wb, xv, yv) + 0.01 * (hp[0] ** 2).sum()

        wb, lam = tuple(inner.params().values()), upper.params(clone=True)["p"].requires_grad_()
        want = sama(f_fn, g_fn, wb, (lam,), SamaConfig(r=0.1, scale=scale))[0]
        self.__dict__.setdefault("checks", []).append(
            (got, want, sama(f_fn, g_fn, wb, (lam,))[0]))
        return {"p": got}


def test_engine_sama_is_preconditioned_by_the_inner_adam_step() -> None:
    engine = sama_bilevel(engine_class=SamaCheck)
    engine.run()
    checks = engine.__dict__["checks"]
    assert len(checks) == ITERS
    for got, want, plain in checks:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
        assert (got - plain).abs().max() > 1e-3 * plain.abs().max()  # P = I would differ


def _trained(cases: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Tensor]]:
    out = []
    for kind, strategy, options in cases:
        engine = (three_levels(strategy, options, lowers=("mid", "low")) if kind == "three"
                  else sama_bilevel(strategy, options))
        engine.run()
        out.append({f"{p.name}.{n}": t.clone() for p in engine.problems.values()
                    for n, t in p.params().items()})
    return out


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Tensor]]:
    was_initialized = metadist.is_initialized()
    kinds = ("three", "sama")
    out = dict(zip(kinds, _trained([(k, "single", {}) for k in kinds]), strict=True))
    if not was_initialized:
        metadist.shutdown()
    return out


RANK_CASES: dict[int, list[tuple[str, dict[str, Any]]]] = {
    2: [("ddp", {}), ("zero1", {})], 3: [("zero3", ZERO3)]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_multilevel_and_sama_engines_match_single_process(
        world_size: int, references: dict[str, dict[str, Tensor]]) -> None:
    """Ten iterations of the three-level engine (both paths) and of the sama bilevel engine
    (Adam preconditioner consolidated from the sharded optimizer state) equal one process
    on the same global batches, on every rank, within the parity tolerances."""
    cases = [(kind, s, o) for s, o in RANK_CASES[world_size] for kind in ("three", "sama")]
    out = run_on_ranks(_trained, world_size, args=(cases,), timeout=300)
    for rank, results in enumerate(out):
        for (kind, strategy, _), got in zip(cases, results, strict=True):
            assert_tensors_close(got, references[kind],
                                 f"{kind} {strategy} ws={world_size} rank={rank}")
