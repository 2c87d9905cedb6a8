"""Fast weights leave a parameter no loss reached as one process does: untouched by the step.

One process leaves ``grad=None`` on a parameter the outer loss does not reach, and SGD with
weight decay and momentum skips it. On zero3/hsdp shards the fast weights are slices of flat
buffers that hold several parameters; the outer gradient of a flat is one tensor, zeros where
nothing reached, and the step used to shrink those parameters by their weight decay. Here a
parameter used by the inner loss only (reached through the second-order terms, not through a
first-order inner loop) and one used by nothing share a flat with parameters the outer loss
uses.
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

INNER_STEPS, META_STEPS, LR = 2, 10, 0.1
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(3, 4)
        self.inner_only = nn.Linear(4, 4)  # the inner loss reads it, the outer loss not
        self.spare = nn.Linear(4, 4)  # nothing reads it
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        h = torch.tanh(self.used(x))
        if inner:
            h = h + torch.tanh(self.inner_only(h))
        out: torch.Tensor = self.head(h)
        return out


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(12, 3, generator=g), torch.randn(12, 1, generator=g)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def reference(create_graph: bool) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process on the whole batch."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), **SGD)
    x, y = _data()
    for _ in range(META_STEPS):
        opt.zero_grad(set_to_none=True)
        fast = dict(net.named_parameters())
        for _ in range(INNER_STEPS):
            inner = _mse(functional_call(net, fast, (x,), {"inner": True}), y)
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=create_graph,
                                        allow_unused=True, materialize_grads=True)
            fast = {n: p - LR * g for (n, p), g in zip(fast.items(), grads, strict=True)}
        _mse(functional_call(net, fast, (x,)), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _fast_weights(strategy: str, options: dict[str, Any],
                  create_graph: bool) -> dict[str, torch.Tensor]:
    s = metadist.strategy(strategy, **options)
    net = Net()
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), **SGD))
    x, y = _data()
    for _ in range(META_STEPS):
        opt.zero_grad(set_to_none=True)
        fast = model.fast_weights()
        xs, ys = (t.chunk(fast.group_size)[fast.group_rank] for t in (x, y))
        for _ in range(INNER_STEPS):
            inner = _mse(model.functional_forward(fast, xs, inner=True), ys)
            fast = fast - LR * fast.grad(inner, create_graph=create_graph)
        s.backward(_mse(model.functional_forward(fast, xs), ys))
        opt.step()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("create_graph", [True, False], ids=["second-order", "first-order"])
@pytest.mark.parametrize(("strategy", "n", "nnodes", "options"), [
    ("ddp", 2, 1, {}),
    ("zero3", 2, 1, {}),
    ("zero3", 3, 1, {"min_unit_params": 20}),
    ("hsdp", 4, 2, {}),
])
def test_a_parameter_no_outer_loss_reaches_is_not_stepped(strategy: str, n: int, nnodes: int,
                                                         options: dict[str, Any],
                                                         create_graph: bool) -> None:
    want = reference(create_graph)
    start = dict(Net().named_parameters())
    # what one process does, so that the comparison below can tell: the spare parameter
    # stays, the inner-only one moves exactly when the second-order terms reach it
    assert torch.equal(want["spare.weight"], start["spare.weight"])
    assert torch.equal(want["inner_only.weight"], start["inner_only.weight"]) != create_graph
    out = run_on_ranks(_fast_weights, n, nnodes=nnodes, args=(strategy, options, create_graph))
    for rank, got in enumerate(out):
        assert_tensors_close(got, want, f"{strategy} x{n} rank {rank}")
        assert torch.equal(got["spare.weight"], start["spare.weight"]), (strategy, rank)
