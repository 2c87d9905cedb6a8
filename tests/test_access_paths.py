"""Every path into a problem's module sees the tensors the engine binds, not only its forward.

While a hypergradient is computed, the engine runs the lower problem on other parameters than
its own (fast weights, a finite-difference perturbation, a replayed window). A program may
reach the module by its forward (``self(x)``), by one of its methods (``self.module.loss``,
as Betty's DARTS example does), by an attribute or a submodule (``self.module.lin(x)``), by
``named_parameters()`` (Betty's learning-by-ignoring example) or by ``state_dict()``. Each
path, in the lower and in the upper problem, must give what the forward path gives; before
the engine bound tensors for the whole computation, every path but the forward silently
read the module's own parameters and lost the implicit hypergradient term.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from metadist.meta import Engine, EngineConfig, Problem, ProblemConfig
from metadist.testing import run_on_ranks

D, BATCH, STEPS = 5, 12, 6
# Same arithmetic on every path, in float64, except the attribute path's matmul in place of
# F.linear (a different rounding of the same products): 1e-10 is far above what six steps of
# these well-conditioned ridge problems amplify that to, far below any lost term.
RTOL, ATOL = 1e-10, 1e-12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, 1, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)

    def loss(self, x: Tensor, y: Tensor, decay: Tensor) -> Tensor:
        """The inner objective as a method of the module (not its forward)."""
        w = self.lin.weight.reshape(-1)
        return 0.5 * ((self(x) - y) ** 2).mean() + 0.5 * (decay * w**2).sum()


class Decay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_decay = nn.Parameter(torch.full((D,), math.log(0.3), dtype=torch.float64))

    def forward(self) -> Tensor:
        return self.log_decay.exp()


def _inner_loss(problem: Problem, path: str, x: Tensor, y: Tensor) -> Tensor:
    decay = problem.hyper()
    match path:
        case "forward":
            w = problem.parameters_dict()["lin.weight"].reshape(-1)
            return 0.5 * ((problem(x) - y) ** 2).mean() + 0.5 * (decay * w**2).sum()
        case "method":
            return problem.module.loss(x, y, decay)  # type: ignore[operator]
        case "attribute":
            lin = problem.module.lin
            w = lin.weight.reshape(-1)
            return (0.5 * ((x @ lin.weight.T + lin.bias - y) ** 2).mean()
                    + 0.5 * (decay * w**2).sum())
        case "named_parameters":
            w = dict(problem.module.named_parameters())["module.lin.weight"].reshape(-1)
            return 0.5 * ((problem(x) - y) ** 2).mean() + 0.5 * (decay * w**2).sum()
        case "state_dict":
            # values only (state_dict detaches): the data term through the forward
            w = problem.module.state_dict(keep_vars=True)["lin.weight"].reshape(-1)
            return 0.5 * ((problem(x) - y) ** 2).mean() + 0.5 * (decay * w**2).sum()
    raise ValueError(path)


class Inner(Problem):
    path = "forward"

    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        return _inner_loss(self, self.path, x, y)


class Hyper(Problem):
    path = "forward"

    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        lam = self.parameters_dict()["log_decay"]
        # another problem's module by a submodule call, or by its forward
        out = self.inner.module.lin(x) if self.path != "forward" else self.inner(x)
        return 0.5 * ((out - y) ** 2).mean() + 0.01 * (lam**2).sum()


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48 + 36, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, 1, generator=g, dtype=torch.float64)
    y = x @ w + 0.5 * torch.randn(48 + 36, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])


def _train(path: str, method: str, strategy: str) -> dict[str, Tensor]:
    train, val = _data()
    net, decay = Net(), Decay()
    inner = Inner("inner", net, torch.optim.SGD(net.parameters(), lr=0.3),
                  train_data_loader=DataLoader(train, batch_size=BATCH),
                  config=ProblemConfig(method=method, unroll_steps=2 if method == "unrolled"
                                       else 1))
    hyper = Hyper("hyper", decay, torch.optim.Adam(decay.parameters(), lr=0.05),
                  train_data_loader=DataLoader(val, batch_size=BATCH))
    inner.path = hyper.path = path
    options = {"min_unit_params": 1} if strategy == "zero3" else {}
    engine = Engine([inner, hyper], EngineConfig(strategy=strategy, strategy_options=options,
                                                 train_iters=STEPS),
                    dependencies={"u2l": {hyper: [inner]}, "l2u": {inner: [hyper]}})
    engine.run()
    return {f"{p.name}.{n}": t.detach().clone() for p in (inner, hyper)
            for n, t in p.wrapped.full_parameters().items()}


def _all_paths(method: str, strategy: str) -> dict[str, dict[str, Tensor]]:
    return {path: _train(path, method, strategy)
            for path in ("forward", "method", "attribute", "named_parameters", "state_dict")}


@pytest.mark.parametrize(("strategy", "world"),
                         [("single", 1), ("ddp", 2), ("zero1", 2), ("zero3", 2)])
@pytest.mark.parametrize("method", ["darts", "neumann", "unrolled"])
def test_every_path_into_a_module_sees_the_bound_parameters(method: str, strategy: str,
                                                            world: int) -> None:
    for rank, results in enumerate(run_on_ranks(_all_paths, world, args=(method, strategy))):
        want = results.pop("forward")
        hyper = want["hyper.log_decay"]
        assert not torch.allclose(hyper, torch.full_like(hyper, math.log(0.3)))  # it learned
        for path, got in results.items():
            for name, value in want.items():
                torch.testing.assert_close(
                    got[name], value, rtol=RTOL, atol=ATOL,
                    msg=lambda m, p=path, n=name, r=rank: f"{method} {strategy} rank {r}: "
                                                          f"path {p}, {n}: {m}")


class _TwoUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lin(x))

    def loss(self, x: Tensor) -> Tensor:
        return (self(x) * self.lin.weight.sum()).sum()


def _method_outside_the_forward() -> str:
    """zero3 outside the engine: a method reads a parameter whose unit was freed after its
    forward (before: a view of freed memory, read past its end: a crash or garbage)."""
    import metadist

    s = metadist.strategy("zero3", min_unit_params=1)
    net = _TwoUnits()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(2, 4)
    model(x).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError) as info:
        model.loss(x)
    return str(info.value)


def test_zero3_parameter_read_outside_its_forward_says_what_to_read() -> None:
    for message in run_on_ranks(_method_outside_the_forward, 2):
        assert "sum of 'lin.weight' reads or combines all of the parameter's elements" in message
        assert "model.full_parameters()['lin.weight']" in message
