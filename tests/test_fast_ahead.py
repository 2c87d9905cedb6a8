"""zero3/hsdp fast weights gather ahead of their use (strategies/fast_ahead.py): the next
unit's gather overlaps the current unit's compute, in the forward and in every backward
that reads saved weights again. What these tests hold it to:

* the values are the ones every gather waited where it is needed gives, bit for bit (the
  same collectives on the same sources);
* every gather started ahead is used on this model (benchmarks/sharded_meta.py counts the
  traffic against the formula too), and all but the first of each forward and of each
  backward's reads are started ahead;
* a guess that does not come (a forward whose order changes) is dropped: the ranks stay in
  step and the result is still one process's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fast_meta
import metadist
from metadist.strategies import fast_ahead
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

WIDE = {"wrap_classes": (nn.Linear,)}
DEPTH, K = 4, fast_meta.INNER_STEPS


def _meta_steps(prefetch: bool, steps: int = 3) -> dict[str, Any]:
    """``steps`` sharded meta-steps of fast_meta's wide MLP; the gathers of the last one."""
    s = metadist.strategy("zero3", prefetch=prefetch, **WIDE)
    model = fast_meta.wide_net(width=24, depth=DEPTH)
    model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 24, generator=g), torch.randn(12, 24, generator=g)
    counts = before = fast_ahead.COUNTS.snapshot()
    for _ in range(steps):
        before = fast_ahead.COUNTS.snapshot()
        opt.zero_grad()
        fast = model.fast_weights()
        xs, ys = (t.chunk(fast.group_size)[fast.group_rank] for t in (x, y))
        for _ in range(K):
            loss = ((model.functional_forward(fast, xs) - ys) ** 2).mean()
            fast = fast - 0.1 * fast.grad(loss)
        s.backward(((model.functional_forward(fast, xs) - ys) ** 2).mean())
        opt.step()
        counts = fast_ahead.COUNTS.snapshot()
    return {"params": {n: p.detach().clone() for n, p in model.full_parameters().items()},
            "started": counts.started - before.started, "used": counts.used - before.used,
            "at_use": counts.at_use - before.at_use, "kept": counts.kept - before.kept}


@pytest.mark.parametrize("n", [2, 3])
def test_gathers_start_ahead_and_change_no_value(n: int) -> None:
    ahead = run_on_ranks(_meta_steps, n, args=(True,), timeout=300)
    serial = run_on_ranks(_meta_steps, n, args=(False,), timeout=300)
    for rank in range(n):
        for name, want in serial[rank]["params"].items():
            assert torch.equal(ahead[rank]["params"][name], want), (rank, name)
        a, s = ahead[rank], serial[rank]
        assert s["started"] == s["kept"] == 0
        # every read served once: by a gather ahead, one where it is needed, or a kept one
        assert a["used"] + a["at_use"] + a["kept"] == s["at_use"], (a, s)
        assert a["started"] == a["used"], f"rank {rank}: a gather started ahead was unused: {a}"
        # Where none can be started ahead: the first saved weight each backward reads, in
        # the K inner backwards and, in the outer one, in each of the K + 1 forwards (every
        # forward's first unit follows the root unit: it is gathered ahead). The outer
        # backward reads each inner forward's weights twice in a row (through the backward
        # recorded on it, first to last, then back): the turn is served by the last gather.
        assert a["at_use"] == K + (K + 1), (rank, a)
        assert a["kept"] == K, (rank, a)


class _Reorder(nn.Module):
    """Two Linear blocks whose order alternates from forward to forward (a model whose
    order no forward predicts)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, flip: bool) -> torch.Tensor:
        first, second = (self.b, self.a) if flip else (self.a, self.b)
        return self.c(torch.tanh(second(torch.tanh(first(x)))))


def _reorder_steps(strategy: str) -> dict[str, Any]:
    s = metadist.strategy(strategy, **(WIDE if strategy == "zero3" else {}))
    model = _Reorder()
    model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    before = fast_ahead.COUNTS.snapshot()
    for step in range(10):
        opt.zero_grad()
        fast = model.fast_weights()
        xs, ys = (t.chunk(fast.group_size)[fast.group_rank] for t in (x, y))
        for k in range(K):
            loss = ((model.functional_forward(fast, xs, (step + k) % 2 == 1) - ys) ** 2).mean()
            fast = fast - 0.1 * fast.grad(loss)
        s.backward(((model.functional_forward(fast, xs, step % 2 == 0) - ys) ** 2).mean())
        opt.step()
    after = fast_ahead.COUNTS.snapshot()
    return {"params": {n: p.detach().clone() for n, p in model.full_parameters().items()},
            "wasted": (after.started - before.started) - (after.used - before.used)}


def test_a_guess_that_does_not_come_is_dropped() -> None:
    """The forwards alternate their order, so gathers started ahead go unused: dropped on
    every rank alike, and 10 meta-steps at 3 ranks equal one process."""
    want = run_on_ranks(_reorder_steps, 1, args=("single",))[0]["params"]
    out = run_on_ranks(_reorder_steps, 3, args=("zero3",), timeout=300)
    for rank, got in enumerate(out):
        assert got["wasted"] > 0, "the forwards' order never differed from the guess"
        assert_tensors_close(got["params"], want, f"zero3 n=3 rank={rank}")


def test_a_kept_or_gathered_buffer_is_used_only_while_nothing_changed() -> None:
    """A buffer kept for the next read was handed to a backward node already, and a piece
    may change in place between a gather and its use: either change makes the read gather
    afresh (None here), never use the old values."""
    piece, buffer = torch.zeros(3), torch.ones(6)
    assert fast_ahead.Ahead(piece, None, kept=buffer).take(piece) is buffer
    changed = fast_ahead.Ahead(piece, None, kept=buffer)
    buffer[:2].mul_(2.0)  # through a view, as a node would write a saved tensor
    assert changed.take(piece) is None
    moved = fast_ahead.Ahead(piece, None, kept=buffer)
    piece.add_(1.0)
    assert moved.take(piece) is None
    assert fast_ahead.Ahead(piece, None, kept=buffer).take(piece.clone()) is None
