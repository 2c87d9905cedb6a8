"""bind_parameters: a module's forward on explicit tensors (plain and nested modules, tied
weights, buffers, nesting, restore on exception, unknown names, a stale cache), re-entered by
activation checkpointing's recomputation (also in double backward), and every strategy's
functional_forward equal to one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import metadist
from metadist.meta import functional_call
from metadist.strategies.activation import apply_activation_checkpointing
from metadist.strategies.bind import (
    bind_parameters,
    explicit_parameters_active,
    rebind_parameters,
)
from metadist.strategies.module import DistributedModule
from metadist.testing import run_on_ranks
from parity import assert_tensors_close


class Tied(nn.Module):
    """Nested modules, a weight used twice, a buffer, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
        self.head = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4, bias=False)
        self.proj = nn.Linear(4, 4, bias=False)
        self.proj.weight = self.out.weight  # tied: one tensor, two uses
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        return self.proj(torch.tanh(self.out(self.head(h)))) * self.scale + self.shift


def reference(net: Tied, x: Tensor, p: dict[str, Tensor]) -> Tensor:
    """The forward written out by hand on ``p`` (net's own tensors where ``p`` has none)."""
    own = {**dict(net.named_parameters()), **dict(net.named_buffers()), **p}
    lin = nn.functional.linear
    h = lin(x, own["body.0.weight"], own["body.0.bias"])
    h = lin(torch.tanh(h), own["body.2.weight"], own["body.2.bias"])
    h = lin(h, own["head.weight"], own["head.bias"])
    h = lin(torch.tanh(lin(h, own["out.weight"])), own["out.weight"])
    return h * own["scale"] + own["shift"]


def own_tensors(net: nn.Module) -> dict[str, Tensor]:
    return {**dict(net.named_parameters(remove_duplicate=False)), **dict(net.named_buffers())}


def test_binds_named_tensors_ties_and_buffers_and_restores() -> None:
    net, x = Tied(), torch.randn(3, 4)
    before = own_tensors(net)
    fast = {"body.0.weight": torch.randn(6, 4), "proj.weight": torch.randn(4, 4),
            "shift": torch.zeros(4), "scale": torch.full((4,), 2.0)}
    assert not explicit_parameters_active(net)
    with bind_parameters(net, fast):
        assert explicit_parameters_active(net)
        assert not explicit_parameters_active(net.body)  # the module bound, not its parts
        got = net(x)
        assert net.out.weight is fast["proj.weight"]  # the other use of the tied weight
    assert not explicit_parameters_active(net)
    want = reference(net, x, {**fast, "out.weight": fast["proj.weight"]})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    after = own_tensors(net)
    assert after.keys() == before.keys()
    assert all(after[k] is v for k, v in before.items())


def test_nests_and_restores_on_exception() -> None:
    net, x = Tied(), torch.randn(3, 4)
    outer, inner = {"head.bias": torch.ones(4)}, {"head.bias": torch.zeros(4),
                                                  "body.2.bias": torch.ones(4)}
    own = net.head.bias
    with bind_parameters(net, outer):
        with bind_parameters(net, inner):
            torch.testing.assert_close(net(x), reference(net, x, inner))
        assert net.head.bias is outer["head.bias"] and net.body[2].bias is not inner["body.2.bias"]
        with pytest.raises(RuntimeError, match="boom"), bind_parameters(net, inner):
            raise RuntimeError("boom")
        assert net.head.bias is outer["head.bias"]
        assert explicit_parameters_active(net)
    assert net.head.bias is own and not explicit_parameters_active(net)


def test_a_block_is_re_enterable() -> None:
    net, x = Tied(), torch.randn(3, 4)
    block = bind_parameters(net, {"head.bias": torch.ones(4)})
    with block:
        with block:
            once = net(x)
        assert net.head.bias is not None and torch.equal(net.head.bias, torch.ones(4))
    torch.testing.assert_close(once, reference(net, x, {"head.bias": torch.ones(4)}))
    assert isinstance(net.head.bias, nn.Parameter)


def test_unknown_and_conflicting_names_raise_saying_what_is_valid() -> None:
    net = Tied()
    with pytest.raises(ValueError, match=r"no parameter or buffer named 'head\.wieght'.*"
                                         r"valid names.*head\.weight"):
        bind_parameters(net, {"head.wieght": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match="name one tied tensor"):
        bind_parameters(net, {"out.weight": torch.zeros(4, 4), "proj.weight": torch.ones(4, 4)})
    same = torch.zeros(4, 4)
    with bind_parameters(net, {"out.weight": same, "proj.weight": same}):
        assert net.proj.weight is same
    # functional_forward and functional_call ignored a misspelled name (torch.func's
    # functional_call does) and ran on the module's own tensor: now they raise
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"'head\.wieght'"):
        DistributedModule(net).functional_forward({"head.wieght": torch.zeros(4, 4)}, x)
    with pytest.raises(ValueError, match=r"'head\.wieght'"):
        functional_call(net, {"head.wieght": torch.zeros(4, 4)}, (x,))


def test_a_changed_module_is_seen_after_binding_once() -> None:
    """The per-module cache of where names live must not outlive the module's structure."""
    net = Tied()
    with bind_parameters(net, {"head.bias": torch.ones(4)}):
        pass
    net.head = nn.Linear(4, 4)  # a new submodule under the same name
    net.proj.weight = nn.Parameter(torch.randn(4, 4))  # untied
    net.extra = nn.Linear(4, 4)  # a name the cache has not seen
    fast = {"head.bias": torch.zeros(4), "proj.weight": torch.eye(4),
            "extra.bias": torch.ones(4)}
    with bind_parameters(net, fast):
        assert net.head.bias is fast["head.bias"] and net.extra.bias is fast["extra.bias"]
        assert net.proj.weight is fast["proj.weight"] and net.out.weight is not net.proj.weight


def test_rebind_keeps_non_leaf_tensors_in_the_parameter_entries() -> None:
    net = Tied()
    new = net.proj.weight * 2
    rebind_parameters(net, {"proj.weight": new})
    assert net.out.weight is new and dict(net.named_parameters())["out.weight"] is new
    assert not explicit_parameters_active(net)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _maml_second_order(net: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """One inner step on fast weights, an outer loss after the bind block ended (the
    recomputation re-enters what the forward ran with), then a double backward."""
    params = dict(net.named_parameters())
    with bind_parameters(net, params):
        inner = net(x).pow(2).mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads, strict=True)}
    with bind_parameters(net, fast):
        outer = net(x).pow(2).mean()
    first = torch.autograd.grad(outer, list(params.values()), create_graph=True)
    penalty = sum((g ** 2).sum() for g in first)
    assert isinstance(penalty, Tensor)
    second = torch.autograd.grad(penalty, list(params.values()))
    # by position: the wrapper's names have "checkpointed." in them
    return {**{f"d.{i}": g for i, g in enumerate(first)},
            **{f"d2.{i}": g for i, g in enumerate(second)}}


def test_activation_checkpointing_recomputes_on_the_bound_weights() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block())
    wrapped = apply_activation_checkpointing(nn.Sequential(Block(), Block()), Block)
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(5, 8)
    assert_tensors_close(_maml_second_order(wrapped, x), _maml_second_order(plain, x))


# ----- every strategy's functional_forward equals one process -------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.frozen(self.blocks(x)))


def _outer_gradients(forward: Any, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fast weights from one inner step (of all parameters, then of the head only), the
    output on them and the outer gradient with respect to the parameters."""
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    out: dict[str, Tensor] = {}
    for label, names in (("all", list(params)), ("head", ["head.weight", "head.bias"])):
        given = {n: params[n] for n in names}
        inner = forward(given, x).pow(2).mean()
        grads = torch.autograd.grad(inner, list(given.values()), create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(given.items(), grads, strict=True)}
        y = forward(fast, x)
        outer = torch.autograd.grad(y.pow(2).mean(), list(given.values()))
        out[f"{label}.y"] = y.detach()
        out.update((f"{label}.d.{n}", g) for n, g in zip(given, outer, strict=True))
    return out


def _on_rank(strategy: str, options: dict[str, Any]) -> dict[str, Tensor]:
    """Every rank reads the same batch, so every rank must compute what one process does."""
    s = metadist.strategy(strategy, **options)
    net = Net()
    model, _ = s.setup(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad],
                                            lr=0.1))
    return _outer_gradients(model.functional_forward, model.full_parameters())


@pytest.mark.parametrize(("strategy", "n", "options"), [
    ("single", 1, {}),
    ("ddp", 3, {}),
    ("zero1", 3, {}),
    ("zero2", 3, {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0005}),
    ("zero3", 3, {"min_unit_params": 10}),
    ("hsdp", 2, {"min_unit_params": 10}),  # 2 nodes x 1 rank
])
def test_every_strategys_functional_forward_equals_one_process(
        strategy: str, n: int, options: dict[str, Any]) -> None:
    net = Net()
    want = _outer_gradients(lambda p, x: torch.func.functional_call(net, p, (x,)),
                            {k: v for k, v in net.named_parameters() if v.requires_grad})
    got = run_on_ranks(_on_rank, n, args=(strategy, options),
                       nnodes=2 if strategy == "hsdp" else 1)
    for rank, result in enumerate(got):
        assert_tensors_close(result, want, where=f"{strategy} rank {rank}")
