"""A hypergradient method registered from outside the package is a method like the built-in
ones: usable by name in ProblemConfig and the engine's bilevel step, with its own config
checked, and listed by the errors that name the choices."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from metadist.meta import (
    CGConfig,
    Engine,
    EngineConfig,
    NeumannConfig,
    ProblemConfig,
    hypergradient,
)
from metadist.meta import methods as registry
from metadist.meta.hypergrad import implicit
from metadist.meta.methods import (
    HypergradientMethod,
    available_hypergradients,
    register_hypergradient,
)
from metadist.meta.optim import GradSync
from metadist.meta.problem import Problem
from test_engine import BATCH, INNER_LR, OUTER_LR, D, Decay, Hyper, Inner, _data


@dataclasses.dataclass(frozen=True)
class IdentityConfig:
    alpha: float = 0.1


@pytest.fixture
def identity() -> Iterator[str]:
    """Registers "identity": the implicit hypergradient with inv(H) ~ alpha I, written here
    as a user would (Neumann with iterations=0 computes the same)."""
    saved = dict(registry._REGISTRY)

    @register_hypergradient("identity", "inverse-by-identity")
    class Identity(HypergradientMethod):
        Config = IdentityConfig

        def hypergradient(self, outer_loss_fn: Any, inner_loss_fn: Any, params: Any,
                          hparams: Sequence[Tensor] | Tensor, config: Any = None, *,
                          grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
            alpha = (self.config_of(config) or IdentityConfig()).alpha
            return implicit(outer_loss_fn, inner_loss_fn, params, hparams, grad_sync,
                            lambda hvp, v: [alpha * t for t in v])

        def for_problem(self, lower: Problem, upper: Problem) -> IdentityConfig:
            given = lower.config.hypergrad
            return (given if isinstance(given, IdentityConfig)
                    else IdentityConfig(alpha=float(lower.optimizer.param_groups[0]["lr"])))

    yield "identity"
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    registry._ALIASES.pop("inverse-by-identity", None)


def _trained(inner_config: ProblemConfig) -> dict[str, Tensor]:
    train, val = _data(False)
    torch.manual_seed(1)
    linear, decay = nn.Linear(D, 1).double(), Decay()
    inner = Inner("inner", linear, torch.optim.SGD(linear.parameters(), lr=INNER_LR),
                  train_data_loader=DataLoader(train, batch_size=BATCH, shuffle=True),
                  config=inner_config)
    hyper = Hyper("hyper", decay, torch.optim.Adam(decay.parameters(), lr=OUTER_LR),
                  train_data_loader=DataLoader(val, batch_size=BATCH, shuffle=True))
    engine = Engine([inner, hyper], EngineConfig(train_iters=10),
                    {"u2l": {hyper: [inner]}, "l2u": {inner: [hyper]}})
    engine.run()
    return {f"{p.name}.{n}": t.clone() for p in engine.problems.values()
            for n, t in p.params().items()}


def test_a_registered_method_trains_by_name(identity: str) -> None:
    assert available_hypergradients()[-2:] == ["identity", "inverse-by-identity"]
    got = _trained(ProblemConfig(method=identity))  # alpha from the inner optimizer's lr
    want = _trained(ProblemConfig(method="neumann",
                                  hypergrad=NeumannConfig(iterations=0, alpha=INNER_LR)))
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert not torch.equal(got["hyper.log_decay"], Decay().log_decay)  # it did train
    aliased = _trained(ProblemConfig(method="inverse-by-identity",
                                     hypergrad=IdentityConfig(alpha=INNER_LR)))
    for name, value in want.items():
        torch.testing.assert_close(aliased[name], value, rtol=0, atol=0, msg=name)


def test_a_registered_method_checks_its_config_and_is_listed(identity: str) -> None:
    with pytest.raises(TypeError, match=r"method 'identity' takes a IdentityConfig, got "
                                        r"CGConfig; pass IdentityConfig\(\.\.\.\) or None"):
        ProblemConfig(method=identity, hypergrad=CGConfig())
    choices = "unrolled, darts, neumann, cg, sama, reinforce, identity, inverse-by-identity"
    with pytest.raises(ValueError, match=f"'newton' is not known; choose one of: {choices}$"):
        ProblemConfig(method="newton")
    with pytest.raises(ValueError, match=f"'newton' is not known; choose one of: {choices}$"):
        hypergradient("newton", lambda p, h: p[0].sum(), lambda p, h: p[0].sum(),
                      (torch.zeros(1),), (torch.zeros(1, requires_grad=True),))
    with pytest.raises(ValueError, match=r"'cg' are already registered; choose another name"):
        register_hypergradient("cg")(type("Other", (HypergradientMethod,), {}))


def test_the_built_in_methods_are_registered_in_order() -> None:
    assert available_hypergradients()[:6] == ["unrolled", "darts", "neumann", "cg", "sama",
                                              "reinforce"]
