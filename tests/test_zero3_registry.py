"""zero3/hsdp keep each parameter in its module's registry (``module._parameters``), holding
what an attribute read gives: the gathered values while its unit runs, a placeholder between
forwards. Every path a one-process program reads a parameter by (the attribute,
``_parameters``, ``parameters()``, ``named_parameters()``, ``state_dict()``) therefore
sees the same thing, instead of an empty module, which made a penalty over
``self.parameters()`` silently zero and ``module._parameters[name]`` a KeyError.

Between forwards a placeholder refuses computation and its ``.grad`` (the gradients are
the flat shards'), so code that reads them there stops with an error naming what to write.

A gradient reaches the shards in whatever layout autograd made it: that of a weight's sum
(an expanded scalar) stopped the reduction with an internal error before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

STEPS, WIDTH, LR, PENALTY = 10, 6, 0.1, 0.01
UNITS = {"wrap_classes": (nn.Linear,)}


class Registry(nn.Linear):
    """A layer that reads its weight through the registry and penalises its own
    parameters inside its forward (as a user's weight-decay-in-forward layer does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._parameters["weight"], self._parameters["bias"]
        assert weight is not None and bias is not None
        named = dict(self.named_parameters())
        penalty = sum((p ** 2).sum() for p in self.parameters()) + named["weight"].mean()
        return torch.tanh(nn.functional.linear(x, weight, bias)) + PENALTY * penalty


class Net(nn.Module):
    def __init__(self, extra: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = Registry(WIDTH, WIDTH), Registry(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra == "parameters":  # at the root, before its children ran
            return self.head(self.b(self.a(x))) + PENALTY * sum(
                (p ** 2).sum() for p in self.parameters())
        out = self.head(self.b(self.a(x)))
        if self.extra == "sum":  # after a ran: the gradient is an expanded scalar
            return out + PENALTY * self.a.weight.sum()
        return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, WIDTH, generator=g), torch.randn(12, 1, generator=g)


def _reference(meta: bool, extra: str = "") -> dict[str, torch.Tensor]:
    net = Net(extra)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step)
        if meta:  # one MAML step on fast weights, second order
            fast = dict(net.named_parameters())
            inner = ((functional_call(net, fast, (x[:6],)) - y[:6]) ** 2).mean()
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
            fast = {n: p - LR * g for (n, p), g in zip(fast.items(), grads, strict=True)}
            loss = ((functional_call(net, fast, (x[6:],)) - y[6:]) ** 2).mean()
        else:
            loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _train(strategy: str, meta: bool, extra: str = "") -> dict[str, torch.Tensor]:
    s = metadist.strategy(strategy, **(UNITS if strategy in ("zero3", "hsdp") else {}))
    net = Net(extra)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step)
        if meta:  # the cooperative form: the ranks split the support and the query sets
            fast = model.fast_weights()
            xs, ys, xq, yq = (t.chunk(fast.group_size)[fast.group_rank]
                              for t in (x[:6], y[:6], x[6:], y[6:]))
            inner = ((model.functional_forward(fast, xs) - ys) ** 2).mean()
            fast = fast - LR * fast.grad(inner)
            loss = ((model.functional_forward(fast, xq) - yq) ** 2).mean()
        else:
            x, y = (t.chunk(s.world.world_size)[s.world.rank] for t in (x, y))
            loss = ((model(x) - y) ** 2).mean()
        s.backward(loss)
        opt.step()
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


@pytest.mark.parametrize(("strategy", "n"), [("zero3", 2), ("zero3", 3), ("ddp", 2)])
def test_a_forward_reading_the_registry_trains_like_one_process(strategy: str, n: int) -> None:
    """``self._parameters[...]``, ``self.parameters()`` and ``self.named_parameters()``
    inside a unit's forward read its gathered values (before: a KeyError)."""
    want = _reference(meta=False)
    for rank, got in enumerate(run_on_ranks(_train, n, args=(strategy, False), timeout=300)):
        assert_tensors_close(got, want, f"{strategy} n={n} rank={rank}")


@pytest.mark.parametrize(("strategy", "n", "extra"),
                         [("zero3", 2, "parameters"), ("zero3", 3, "parameters"),
                          ("zero3", 2, "sum")])
def test_fast_weights_reach_every_parameter_read_in_the_forward(strategy: str, n: int,
                                                                extra: str) -> None:
    """On fast weights, a penalty over every ``self.parameters()`` at the root, before any
    unit ran, reads the fast weights (before: the registry was empty, the penalty silently
    zero, and the result differed from one process; and the gradient of the weight's sum,
    an expanded tensor, stopped the shard reduction with an internal error)."""
    want = _reference(True, extra)
    for rank, got in enumerate(run_on_ranks(_train, n, args=(strategy, True, extra),
                                            timeout=300)):
        assert_tensors_close(got, want, f"{strategy} n={n} rank={rank}")


def _outside(check: str) -> Any:
    s = metadist.strategy("zero3", **UNITS)
    net = Net("parameters" if check == "penalty" else "")
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    x, y = _batch(0)
    if check == "count":
        return sum(p.numel() for p in net.parameters()), [n for n, _ in net.named_parameters()]
    if check == "state_dict":
        return {k: v.clone() for k, v in net.state_dict().items()}
    if check == "to":  # moving or converting the set-up model moves its shards
        for convert in (lambda: model.to("cpu"), model.float, model.cpu):
            convert()
        return [n for n, _ in net.named_parameters()]
    try:
        if check == "penalty":
            model(x)
        else:
            s.backward(((model(x) - y) ** 2).mean())
            if check == "zero_grad":
                net.zero_grad()
            elif check == "net.to":
                net.to("cpu")
            else:  # a hand-written gradient norm over the user's module
                sum(p.grad.norm() ** 2 for p in net.parameters() if p.grad is not None)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def test_reads_between_forwards_describe_or_refuse() -> None:
    """Between forwards the user's module lists its parameters as one process's does
    (names, shapes: a parameter count is right), ``model.to(...)`` and ``.float()`` move the
    shards and leave it so, its state dict is one process's, and what
    needs values or gradients there raises, naming what to write (before: the module looked
    empty, so ``net.zero_grad()`` and a hand-written gradient norm silently did nothing)."""
    plain = Net()
    count = sum(p.numel() for p in plain.parameters()), [n for n, _ in plain.named_parameters()]
    assert run_on_ranks(_outside, 2, args=("count",)) == [count, count]
    assert run_on_ranks(_outside, 2, args=("to",)) == [count[1]] * 2  # in their order
    for got in run_on_ranks(_outside, 2, args=("state_dict",)):
        assert_tensors_close(got, plain.state_dict(), "net.state_dict()")
    # the user's module holds the parameters' slices (zero3/sharded_param.py): zeroing
    # its gradients and a hand-written norm of them run (test_user_params.py has the values)
    for check in ("zero_grad", "norm"):
        assert run_on_ranks(_outside, 2, args=(check,)) == [None, None]
    for check, says in (("net.to", "model.to(...)"), ("penalty", "full_parameters")):
        for message in run_on_ranks(_outside, 2, args=(check,)):
            assert message is not None and "zero3" in message and says in message, (
                check, message)
