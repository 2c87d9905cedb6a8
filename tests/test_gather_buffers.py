"""zero3/hsdp fast weights gather into reused buffers (strategies/zero3/gather_buffers.py).

What these tests hold it to:

* after the first meta-step no gather allocates a buffer of a unit's full size: the
  meta-step's traffic is the collectives' own bytes, not fresh pages;
* a buffer is reused only when nothing else holds it, and the buffers in use at once stay
  those in flight (a unit, the next one gathered ahead, a forward's last unit kept for the
  backward): a reused buffer's saved views are still kept as references to their pieces;
* the values are one process's (the suite's parity tests run the same paths), and the
  second-order gradient of a saved view is reduced from where it lies, with the same parts
  on every rank;
* the memory measures count the buffers the pool keeps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fast_meta
import metadist
from metadist.strategies.zero3 import gather_buffers
from metadist.strategies.zero3.gather_buffers import GatherBuffers, zeros
from metadist.strategies.zero3.shard_gather import _dense
from metadist.testing import peak_bytes_of, run_on_ranks
from parity import assert_tensors_close

WIDE = {"wrap_classes": (nn.Linear,)}
# units of 1 MiB: the collectives run their ring (smaller ones are concatenated for one
# all-reduce, a copy that costs less than the latency it saves)
WIDTH, DEPTH, K = 512, 4, fast_meta.INNER_STEPS


class _WholeAllocations(TorchDispatchMode):
    """Counts the storages operators allocate of exactly ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.new_empty,
                                   torch.ops.aten.empty_strided) \
                and isinstance(out, torch.Tensor) and out.numel() == self.numel:
            self.count += 1
        return out


def _meta_step(s: Any, model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    fast = model.fast_weights()
    xs, ys = (t.chunk(fast.group_size)[fast.group_rank] for t in (x, y))
    for _ in range(K):
        loss = ((model.functional_forward(fast, xs) - ys) ** 2).mean()
        fast = fast - 0.1 * fast.grad(loss)
    s.backward(((model.functional_forward(fast, xs) - ys) ** 2).mean())
    opt.step()


def _allocations(strategy: str, steps: int) -> dict[str, Any]:
    """``steps`` meta-steps; per step, the storages of a unit's full (padded) size allocated."""
    gather_buffers.let_go()
    s = metadist.strategy(strategy, **(WIDE if strategy == "zero3" else {}))
    model = fast_meta.wide_net(width=WIDTH, depth=DEPTH)
    model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, WIDTH, generator=g), torch.randn(12, WIDTH, generator=g)
    padded = model.flats[0].padded if strategy == "zero3" else -1
    counts = []
    for _ in range(steps):
        with _WholeAllocations(padded) as whole:
            _meta_step(s, model, opt, x, y)
        counts.append(whole.count)
    held = {k[0]: len(v) for k, v in gather_buffers.BUFFERS._buffers.items()}
    return {"counts": counts, "held": held, "padded": padded,
            "params": {n: p.detach().clone() for n, p in model.full_parameters().items()}}


@pytest.mark.parametrize("n", [2, 3])
def test_gathers_reuse_their_buffers_and_equal_one_process(n: int) -> None:
    want = run_on_ranks(_allocations, 1, args=("single", 4))[0]["params"]
    out = run_on_ranks(_allocations, n, args=("zero3", 4), timeout=300)
    for rank, got in enumerate(out):
        first, *later = got["counts"]
        assert first > 0, got  # the first meta-step fills the pool
        assert later == [0] * len(later), f"rank {rank}: whole buffers allocated {later}"
        # in flight at once: a unit and the next one ahead, or a backward's read and its
        # neighbour ahead, and a forward's last unit kept for the backward
        assert got["held"][got["padded"]] <= 3, (rank, got["held"])
        assert_tensors_close(got["params"], want, f"zero3 n={n} rank={rank}")


def test_a_buffer_is_reused_only_when_nothing_else_holds_it() -> None:
    pool, cpu = GatherBuffers(kept=2), torch.device("cpu")
    a = pool.take(8, torch.float32, cpu)
    b = pool.take(8, torch.float32, cpu)  # ``a`` is held, even with no view of it made yet
    assert b.data_ptr() != a.data_ptr()
    view = a[2:5]  # a user of the buffer: a parameter view, a saved tensor
    del a
    c = pool.take(8, torch.float32, cpu)  # the view still reads the first buffer
    assert c.data_ptr() not in (view.data_ptr() - 8, b.data_ptr())
    assert len(pool._buffers[(8, torch.float32, cpu)]) == 2  # kept: 2, the third is not
    del view
    d = pool.take(8, torch.float32, cpu)  # the first buffer is free again
    assert d.untyped_storage().data_ptr() == pool._buffers[(8, torch.float32, cpu)][0].data_ptr()
    assert pool.counts.reused == 1 and pool.counts.allocated == 3
    assert pool.idle_bytes() == 0  # ``b`` and ``d`` hold both kept buffers
    del b, d
    assert pool.idle_bytes() == 2 * 8 * 4
    pool.clear()
    assert pool.idle_bytes() == 0


def test_zeros_are_shared_and_recover_from_a_write() -> None:
    z = zeros(5, torch.float32, torch.device("cpu"))
    assert torch.equal(z, torch.zeros(5))
    assert zeros(3, torch.float32, torch.device("cpu")).data_ptr() == z.data_ptr()
    z.add_(1.0)  # nobody may write them; if someone does, the next parts are zeros again
    assert torch.equal(zeros(5, torch.float32, torch.device("cpu")), torch.zeros(5))


@pytest.mark.parametrize(("shape", "perm", "dense"), [
    ((3, 4), (0, 1), True), ((3, 4), (1, 0), True), ((2, 3, 4), (2, 0, 1), True),
    ((1, 4), (1, 0), True)])
def test_dense_layouts(shape: tuple[int, ...], perm: tuple[int, ...], dense: bool) -> None:
    assert _dense(torch.empty(shape).permute(perm)) is dense


@pytest.mark.parametrize("make", [lambda: torch.empty(3, 8)[:, :4],
                                  lambda: torch.empty(4).expand(3, 4),
                                  lambda: torch.empty(6, 4)[::2]])
def test_layouts_with_gaps_or_repeats_are_not_dense(make: Any) -> None:
    assert not _dense(make())


def _peak_counts_the_pool() -> tuple[int, int]:
    gather_buffers.let_go()
    gather_buffers.BUFFERS.take(1000, torch.float32, torch.device("cpu"))  # idle, filled before
    peak = peak_bytes_of(lambda: gather_buffers.BUFFERS.take(1000, torch.float32,
                                                               torch.device("cpu")))[1]
    return peak, sum(len(v) for v in gather_buffers.BUFFERS._buffers.values())


def test_memory_measures_count_what_the_pool_keeps() -> None:
    """A buffer the pool kept from before is allocated again inside a measure (the measure
    empties the pool first), and the pool's idle buffers are let go when it ends."""
    peak, kept_after = _peak_counts_the_pool()
    assert peak == 1000 * 4
    assert kept_after == 0
