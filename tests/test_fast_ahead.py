"""zero3/hsdp fast weights gather ahead of their use (strategies/zero3/fast_ahead.py): the next
unit's gather overlaps the current unit's compute, in the forward and in every backward
that reads saved weights again. What these tests hold it to:

* the values are the ones every gather waited where it is needed gives, bit for bit (the
  same collectives on the same sources);
* every gather started ahead is used on this model (benchmarks/sharded_meta.py counts the
  traffic against the formula too), and all but the first of each forward and of each
  backward's reads are started ahead or kept from the read before (a forward's last unit
  for the backward that follows it, one at a time);
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
from metadist.comm import stats
from metadist.strategies.zero3 import fast_ahead
from metadist.testing import bytes_kept_by, run_on_ranks
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
        # Every forward's first unit follows the root unit: it is gathered ahead. A
        # forward's last unit stays gathered for the backward that follows and reads it
        # first: the K inner backwards and the outer one's read of the outer forward
        # (K + 1). The outer backward reads each inner forward's weights twice in a row
        # (through the backward recorded on it, first to last, then back): the turn is
        # served by the last gather (K). None serves the first read of each of those walks.
        assert a["at_use"] == K, (rank, a)
        assert a["kept"] == (K + 1) + K, (rank, a)


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


def _forwards_kept(prefetch: bool, forwards: int) -> dict[str, Any]:
    """The bytes ``forwards`` forwards on fast weights leave alive before any backward (their
    graphs, and a last unit kept whole), and the meta-gradient of their summed losses."""
    s = metadist.strategy("zero3", prefetch=prefetch, **WIDE)
    model = fast_meta.wide_net(width=24, depth=DEPTH)
    model, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(forwards, 12, 24, generator=g)
    fast = model.fast_weights()
    fast = fast - 0.1 * fast.grad(model.functional_forward(fast, x[0]).square().mean())
    losses, kept = bytes_kept_by(lambda: [model.functional_forward(fast, x[i]).square().mean()
                                          for i in range(forwards)])
    s.backward(sum(losses))
    return {"kept": kept, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_forwards_before_a_backward_keep_one_last_unit_between_them() -> None:
    """Each forward's last unit stays whole for the backward that follows; four forwards
    before any backward keep one such unit between them, not four (a later forward's keep
    lets the earlier one go), and the meta-gradient is the one of no prefetch, bit for bit."""
    ahead = run_on_ranks(_forwards_kept, 2, args=(True, 4), timeout=300)
    serial = run_on_ranks(_forwards_kept, 2, args=(False, 4), timeout=300)
    one = 24 * 25 * 4  # one Linear(24, 24) unit, whole (float32; 2 ranks divide it evenly)
    for rank in range(2):
        assert ahead[rank]["kept"] - serial[rank]["kept"] == one, (rank, ahead[rank]["kept"],
                                                                  serial[rank]["kept"])
        for name, want in serial[rank]["grads"].items():
            assert torch.equal(ahead[rank]["grads"][name], want), (rank, name)


class _Block(nn.Module):
    """A unit of three layers that each save their weight (a transformer block's shape):
    a backward reads the three saved views one after the other."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))


def _block_steps(strategy: str, prefetch: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(16), _Block(16), _Block(16))
    options = {"wrap_classes": (_Block,), "prefetch": prefetch} if strategy == "zero3" else {}
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)
    before = fast_ahead.COUNTS.snapshot()
    for _ in range(10):
        with stats.counting() as counted:  # the last meta-step's are kept
            opt.zero_grad()
            fast = model.fast_weights()
            xs, ys = (t.chunk(fast.group_size)[fast.group_rank] for t in (x, y))
            for _ in range(K):
                loss = ((model.functional_forward(fast, xs) - ys) ** 2).mean()
                fast = fast - 0.1 * fast.grad(loss)
            s.backward(((model.functional_forward(fast, xs) - ys) ** 2).mean())
            opt.step()
    after = fast_ahead.COUNTS.snapshot()
    scatters = counted.ops["reduce_scatter"].calls if "reduce_scatter" in counted.ops else 0
    return {"params": {n: p.detach().clone() for n, p in model.full_parameters().items()},
            "gathers": (after.started + after.at_use) - (before.started + before.at_use),
            "scatters": scatters}


@pytest.mark.parametrize("n", [2, 3])
def test_a_units_several_saved_weights_share_one_gather(n: int) -> None:
    """A backward reading a block's three saved weights gathers the block once for them
    (kept until it reads another unit), not three times, and reduce-scatters their
    second-order gradients once; 10 meta-steps equal one process."""
    want = run_on_ranks(_block_steps, 1, args=("single", True))[0]["params"]
    ahead = run_on_ranks(_block_steps, n, args=("zero3", True), timeout=300)
    serial = run_on_ranks(_block_steps, n, args=("zero3", False), timeout=300)
    for rank in range(n):
        assert_tensors_close(ahead[rank]["params"], want, f"zero3 n={n} rank={rank}")
        # serial gathers each saved view where it is read: three per block and backward read
        assert ahead[rank]["gathers"] * 2 < serial[rank]["gathers"], (ahead[rank]["gathers"],
                                                                     serial[rank]["gathers"])
        # reduce-scatters: every block's gradient in the K inner backwards and of the K + 1
        # forwards in the outer one, and the second-order gradients of a block's three saved
        # weights summed into one for each of the K inner steps
        blocks = 3
        assert ahead[rank]["scatters"] == K * blocks + (K + 1) * blocks + K * blocks, ahead[rank]


class _Headed(nn.Module):
    """A language model's layout: the root unit holds an embedding, read first, and a norm
    and head, read last (the first weights a backward reads), around blocks of several
    saved weights each."""

    def __init__(self, vocab: int = 11, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(_Block(width) for _ in range(blocks)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids))))


def _headed_steps(strategy: str, prefetch: bool) -> dict[str, Any]:
    model = _Headed()
    options = {"wrap_classes": (_Block,), "prefetch": prefetch} if strategy == "zero3" else {}
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    ids, targets = (torch.randint(0, 11, (12, 5), generator=g) for _ in range(2))

    def loss(fast: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model.functional_forward(fast, x)
        return nn.functional.cross_entropy(out.reshape(-1, 11), y.reshape(-1))

    counts = before = fast_ahead.COUNTS.snapshot()
    for _ in range(10):
        before = fast_ahead.COUNTS.snapshot()
        opt.zero_grad()
        fast = model.fast_weights()
        xs, ys = (t.chunk(fast.group_size)[fast.group_rank] for t in (ids, targets))
        for _ in range(K):
            fast = fast - 0.1 * fast.grad(loss(fast, xs, ys))
        s.backward(loss(fast, xs, ys))
        opt.step()
        counts = fast_ahead.COUNTS.snapshot()
    return {"params": {n: p.detach().clone() for n, p in model.full_parameters().items()},
            "started": counts.started - before.started, "used": counts.used - before.used,
            "at_use": counts.at_use - before.at_use}


@pytest.mark.parametrize("n", [2, 3])
def test_a_root_units_head_is_read_first_and_every_guess_comes(n: int) -> None:
    """The backward reads a root unit's head first, then the blocks last to first: the
    guesses follow the order the forward saved the weights in (not the order it gathered
    them in), so every gather started ahead is used, and only each forward's root unit
    and each of the outer backward's walks into an earlier forward wait for their gather;
    10 meta-steps equal one process, and no prefetch bit for bit."""
    want = run_on_ranks(_headed_steps, 1, args=("single", True))[0]["params"]
    ahead = run_on_ranks(_headed_steps, n, args=("zero3", True), timeout=300)
    serial = run_on_ranks(_headed_steps, n, args=("zero3", False), timeout=300)
    for rank in range(n):
        a = ahead[rank]
        assert_tensors_close(a["params"], want, f"zero3 n={n} rank={rank}")
        for name, value in serial[rank]["params"].items():
            assert torch.equal(a["params"][name], value), (rank, name)
        counts = {k: a[k] for k in ("started", "used", "at_use")}
        assert a["started"] == a["used"], f"rank {rank}: a gather ahead was unused: {counts}"
        assert a["at_use"] == (K + 1) + K, (rank, counts)
