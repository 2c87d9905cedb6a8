"""``torchopt.diff`` (implicit and zero-order differentiation) and ``torchopt.nn`` of the
drop-in against TorchOpt 0.7.3 itself, in float64: the same programs run on both and every
gradient is compared. TorchOpt's own tests of these need JAX for their numbers (skipped
without it, so the suite alone checks only the errors); these are the numbers."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import peers

Results = dict[str, Any]


def _data(n: int = 24, d: int = 5, k: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, dtype=torch.float64, generator=g)
    y = torch.randint(0, k, (n,), generator=g)
    w = torch.randn(k, d, dtype=torch.float64, generator=g) * 0.1
    b = torch.zeros(k, dtype=torch.float64)
    return x, y, w, b


def _custom_root(to: Any) -> Results:
    """iMAML's inner problem (cross-entropy + 0.5 |params - meta|^2, solved by 30 SGD steps)
    with each linear solver, the solution a tuple, the data by keyword or in a tuple."""
    x, y, w, b = _data()

    def objective(params: Any, meta: Any, data: Any) -> torch.Tensor:
        xs, ys = data
        reg = sum(0.5 * ((p - m) ** 2).sum() for p, m in zip(params, meta, strict=True))
        return F.cross_entropy(xs @ params[0].T + params[1], ys) + reg

    out: Results = {}
    solvers = {"normal_cg": to.linear_solve.solve_normal_cg(),
               "cg": to.linear_solve.solve_cg(maxiter=20),
               "inv": to.linear_solve.solve_inv(),
               "inv_ns": to.linear_solve.solve_inv(ns=True, maxiter=30, alpha=0.5),
               "default": None}
    for name, solve in solvers.items():
        kw = {} if solve is None else {"solve": solve}

        @to.diff.implicit.custom_root(torch.func.grad(objective, argnums=0), argnums=1,
                                      has_aux=True, **kw)
        def solver(params: Any, meta: Any, data: Any) -> Any:
            opt = to.sgd(lr=0.5)
            state = opt.init(params)
            with torch.enable_grad():
                for _ in range(30):
                    grads = torch.autograd.grad(objective(params, meta, data), params)
                    updates, state = opt.update(grads, state, inplace=True)
                    params = to.apply_updates(params, updates, inplace=True)
            return params, {"steps": 30}

        meta = (w.clone().requires_grad_(), b.clone().requires_grad_())
        init = tuple(m.detach().clone().requires_grad_() for m in meta)
        sol, aux = solver(init, meta, data=(x, y))
        assert aux == {"steps": 30}
        out[name] = torch.autograd.grad((x @ sol[0].T + sol[1]).square().mean(), meta)
    return out


def _custom_root_tensor(to: Any) -> Results:
    """Ridge regression solved in closed form, one tensor out, the gradient with respect to
    the regularisation strength (a scalar) and the data."""
    x, _, _, _ = _data()
    t = x[:, 0] * 0.7 - x[:, 1]

    def optimality(beta: torch.Tensor, lam: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return xs.T @ (xs @ beta - t) + lam * beta

    @to.diff.implicit.custom_root(optimality, argnums=(1, 2),
                                  solve=to.linear_solve.solve_cg(ridge=1e-3))
    def ridge(beta: torch.Tensor, lam: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        a = xs.T @ xs + lam * torch.eye(xs.shape[1], dtype=xs.dtype)
        return torch.linalg.solve(a, xs.T @ t)

    lam = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    xs = x.clone().requires_grad_()
    beta = ridge(torch.zeros(5, dtype=torch.float64), lam, xs)
    return {"ridge": torch.autograd.grad(beta.square().sum(), (lam, xs))}


def _implicit_module(to: Any) -> Results:
    """ImplicitMetaGradientModule with a meta-module from the constructor: the optimality
    derived from ``objective``, and one written out."""
    x, y, w, b = _data()
    out: Results = {}
    for kind in ("objective", "optimality"):
        meta = nn.Linear(5, 3).double()
        with torch.no_grad():
            meta.weight.copy_(w)
            meta.bias.copy_(b)

        def objective(self: Any, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            reg = sum(0.5 * ((p - m) ** 2).sum() for p, m in
                      zip(self.parameters(), self.meta_parameters(), strict=True))
            return F.cross_entropy(self.net(xs), ys) + reg

        def optimality(self: Any, xs: torch.Tensor, ys: torch.Tensor) -> Any:
            metas = tuple(self.meta_parameters())

            def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
                reg = sum(0.5 * ((q - m) ** 2).sum() for q, m in
                          zip(p.values(), metas, strict=True))
                out = torch.func.functional_call(self.net, p, (xs,))
                return F.cross_entropy(out, ys) + reg

            g = torch.func.grad(f)(dict(self.net.named_parameters()))
            return g["weight"], g["bias"]

        def solve(self: Any, xs: torch.Tensor, ys: torch.Tensor) -> None:
            params = tuple(self.parameters())
            opt = torch.optim.SGD(params, lr=0.5)
            with torch.enable_grad():
                for _ in range(30):
                    opt.zero_grad()
                    self.objective(xs, ys).backward(inputs=params)
                    opt.step()

        def init(self: Any, meta_net: nn.Module) -> None:
            super(type(self), self).__init__()
            self.meta_net = meta_net
            self.net = nn.Linear(5, 3).double()
            self.net.load_state_dict(meta_net.state_dict())

        body = {"__init__": init, "objective": objective, "solve": solve}
        if kind == "optimality":
            body["optimality"] = optimality
        Inner = type(kind, (to.nn.ImplicitMetaGradientModule,), body,  # noqa: N806
                     linear_solve=to.linear_solve.solve_cg(maxiter=25))
        inner = Inner(meta)
        inner.solve(x, y)
        loss = inner.net(x).square().mean()
        out[kind] = torch.autograd.grad(loss, tuple(meta.parameters()))
        out[kind + "_names"] = [n for n, _ in inner.named_meta_parameters()]
    return out


def _zero_order(to: Any) -> Results:
    """Each estimator, 3 samples, sigma 0.5, seeded: the function and the module forms."""
    x, _, w, _ = _data()
    out: Results = {}
    for method in ("naive", "forward", "antithetic"):
        torch.manual_seed(7)

        @to.diff.zero_order(torch.distributions.Normal(0.0, 1.0), method=method, argnums=(0, 2),
                            num_samples=3, sigma=0.5)
        def f(params: Any, xs: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
            return (xs @ params[0].T + params[1] + shift).square().mean()

        params = (w.clone().requires_grad_(), torch.ones(3, dtype=torch.float64,
                                                          requires_grad=True))
        shift = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        out[method] = torch.autograd.grad(2.0 * f(params, x, shift), (*params, shift))

        class Module(to.nn.ZeroOrderGradientModule,  # type: ignore[misc, name-defined]
                     method=method, num_samples=4, sigma=0.2):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(5, 1).double()

            def forward(self, xs: torch.Tensor) -> torch.Tensor:
                return self.fc(xs).square().mean()

            def sample(self, sample_shape: torch.Size = torch.Size()  # noqa: B008
                       ) -> torch.Tensor:
                return torch.randn(sample_shape, dtype=torch.float64)

        torch.manual_seed(8)
        m = Module()
        out[method + "_module"] = torch.autograd.grad(m(x), tuple(m.parameters()))
    return out


def _stateless(to: Any) -> Results:
    """reparametrize / swap_state and MetaGradientModule's split of parameters."""
    x, _, w, b = _data()
    net = nn.Linear(5, 3).double()
    with to.nn.reparametrize(net, {"weight": w, "bias": b}) as m:
        inside = m(x)
    old = to.nn.swap_state(net, [("weight", w)])
    after = net.weight is w
    to.nn.swap_state(net, old)
    meta = torch.ones(3, dtype=torch.float64, requires_grad=True)
    mg = to.nn.MetaGradientModule(meta)
    mg.scale = meta
    mg.offset = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    mg.fc = nn.Linear(2, 2)
    return {"inside": inside, "swapped": after, "restored": net.weight is not w,
            "params": [n for n, _ in mg.named_parameters()],
            "meta": [n for n, _ in mg.named_meta_parameters()]}


PROGRAMS: dict[str, Callable[[Any], Results]] = {
    "custom_root": _custom_root, "custom_root_tensor": _custom_root_tensor,
    "implicit_module": _implicit_module, "zero_order": _zero_order, "stateless": _stateless}


def _run_all(impl: str) -> dict[str, Results]:
    if impl == "torchopt":
        peers.use()
    to = importlib.import_module("torchopt" if impl == "torchopt" else
                                 "metadist.compat.torchopt")
    return {name: program(to) for name, program in PROGRAMS.items()}


@pytest.fixture(scope="module")
def both() -> tuple[dict[str, Results], dict[str, Results]]:
    return _run_all("compat"), peers.run_on(1, _run_all, ("torchopt",))[0]


def _cases() -> list[tuple[str, str]]:
    keys = {"custom_root": ["normal_cg", "cg", "inv", "inv_ns", "default"],
            "custom_root_tensor": ["ridge"],
            "implicit_module": ["objective", "optimality", "objective_names",
                                "optimality_names"],
            "zero_order": [m + s for m in ("naive", "forward", "antithetic")
                           for s in ("", "_module")],
            "stateless": ["inside", "swapped", "restored", "params", "meta"]}
    return [(p, k) for p, ks in keys.items() for k in ks]


@pytest.mark.parametrize(("program", "key"), _cases())
def test_same_as_torchopt(both: tuple[dict[str, Results], dict[str, Results]], program: str,
                          key: str) -> None:
    ours, theirs = both[0][program][key], both[1][program][key]
    if isinstance(theirs, (bool, list)):  # names, identities
        assert ours == theirs
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_the_comparison_sees_a_difference(both: tuple[dict[str, Results], dict[str, Results]]
                                          ) -> None:
    """The programs are sensitive: the implicit gradients differ between solvers that stop
    at different tolerances, and the estimators between methods."""
    ours = both[0]
    assert not torch.allclose(ours["zero_order"]["naive"][0], ours["zero_order"]["forward"][0])
    a, b = ours["custom_root"]["cg"], ours["custom_root"]["inv_ns"]
    assert not all(torch.allclose(u, v, rtol=1e-12, atol=1e-12) for u, v in zip(a, b,
                                                                               strict=True))
