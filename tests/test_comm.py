"""The collectives, fused collectives, counters and error messages on real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import metadist
from metadist import comm
from metadist.comm import stats
from metadist.testing import run_on_ranks

SIZES = [1, 2, 3, 4]


def _every_collective(impl: str) -> dict[str, list[float]]:
    w = metadist.world()
    r, n = w.rank, w.world_size
    out: dict[str, list[float]] = {}
    for op in ("sum", "mean", "max", "min", "prod"):
        t = torch.tensor([r + 1.0, 2.0 * (r + 1)])
        comm.all_reduce(t, op)
        out[f"all_reduce/{op}"] = t.tolist()
    t = torch.tensor([float(r)] * 3)
    comm.broadcast(t, src=n - 1)
    out["broadcast"] = t.tolist()
    t = torch.tensor([r + 1.0])
    comm.reduce(t, dst=0, op="sum")
    out["reduce"] = t.tolist() if r == 0 else []
    gathered = torch.empty(2 * n)
    comm.all_gather(gathered, torch.tensor([r, 10.0 + r]), impl=impl)  # type: ignore[arg-type]
    out["all_gather"] = gathered.tolist()
    piece = torch.empty(2)
    comm.reduce_scatter(piece, torch.arange(2.0 * n) + r, "sum", impl=impl)  # type: ignore[arg-type]
    out["reduce_scatter"] = piece.tolist()
    piece = torch.empty(1)
    comm.reduce_scatter(piece, torch.arange(1.0 * n) * (r + 1), "mean", impl=impl)  # type: ignore[arg-type]
    out["reduce_scatter/mean"] = piece.tolist()
    got = torch.empty(1)
    comm.scatter(got, [torch.tensor([100.0 + i]) for i in range(n)] if r == 0 else None, src=0)
    out["scatter"] = got.tolist()
    slots = [torch.empty(1) for _ in range(n)] if r == n - 1 else None
    comm.gather(torch.tensor([r * 3.0]), slots, dst=n - 1)
    out["gather"] = [s.item() for s in slots] if slots else []
    received = torch.empty(n)
    comm.all_to_all(received, torch.tensor([10.0 * r + s for s in range(n)]))
    out["all_to_all"] = received.tolist()
    comm.barrier()
    out["object"] = comm.all_gather_object({"rank": r})  # type: ignore[assignment]
    out["broadcast_object"] = [comm.broadcast_object(r * 7 if r == 1 % n else None, src=1 % n)]
    return out


def _expected(r: int, n: int) -> dict[str, list[float]]:
    ranks = range(n)
    prod1 = 1.0
    prod2 = 1.0
    for k in ranks:
        prod1 *= k + 1
        prod2 *= 2 * (k + 1)
    s1 = sum(k + 1.0 for k in ranks)
    return {
        "all_reduce/sum": [s1, 2 * s1],
        "all_reduce/mean": [s1 / n, 2 * s1 / n],
        "all_reduce/max": [float(n), 2.0 * n],
        "all_reduce/min": [1.0, 2.0],
        "all_reduce/prod": [prod1, prod2],
        "broadcast": [float(n - 1)] * 3,
        "reduce": [s1] if r == 0 else [],
        "all_gather": [v for k in ranks for v in (float(k), 10.0 + k)],
        "reduce_scatter": [sum(2.0 * r + j + k for k in ranks) for j in range(2)],
        "reduce_scatter/mean": [sum(r * (k + 1.0) for k in ranks) / n],
        "scatter": [100.0 + r],
        "gather": [k * 3.0 for k in ranks] if r == n - 1 else [],
        "all_to_all": [10.0 * k + r for k in ranks],
        "object": [{"rank": k} for k in ranks],  # type: ignore[dict-item]
        "broadcast_object": [7 if n > 1 else 0],
    }


@pytest.mark.parametrize(("n", "impl"), [(1, "auto")] + [(n, i) for n in SIZES[1:]
                                                           for i in ("auto", "native")])
def test_every_collective_matches_its_definition(n: int, impl: str) -> None:
    for r, got in enumerate(run_on_ranks(_every_collective, n, args=(impl,))):
        want = _expected(r, n)
        assert got.keys() == want.keys()
        for key in want:
            # Small integers in float32: every expected value is exact.
            assert got[key] == want[key], f"{key} on rank {r} of {n}"


def _async_handles() -> tuple[list[float], bool, list[float]]:
    r = metadist.world().rank
    a = torch.full((4,), float(r))
    b = torch.full((2,), 1.0)
    ha = comm.all_reduce(a, "mean", async_op=True)
    hb = comm.all_reduce(b, "sum", async_op=True)
    result = ha.wait()
    hb.wait()
    hb.wait()  # idempotent
    return result.tolist(), hb.is_completed(), b.tolist()


def test_async_handles_finish_on_wait() -> None:
    for got in run_on_ranks(_async_handles, 3):
        assert got == ([1.0] * 4, True, [3.0, 3.0])


def _fused_vs_plain() -> tuple[bool, int, int]:
    r = metadist.world().rank
    g = torch.Generator().manual_seed(r)
    tensors = [torch.randn(s, generator=g) for s in [(3,), (2, 5), (7,), (1,)]]
    tensors += [torch.randn(4, generator=g).double(), torch.arange(6).view(2, 3) + r]
    tensors.append(torch.randn(4, 6, generator=g).t())  # non-contiguous
    plain = [t.clone() for t in tensors]
    for t in plain:
        c = t.contiguous()
        comm.all_reduce(c)
        t.copy_(c)
    with stats.counting() as counted:
        comm.fused_all_reduce(tensors, bucket_cap_mb=64 / 2**20)  # 64-byte buckets
    with stats.counting() as one_bucket:
        comm.fused_broadcast([t.clone() for t in tensors], src=0)
    # gloo's ring may chunk a fused buffer differently, so sums can differ in the last bit.
    same = all(a.dtype == b.dtype and torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-6)
               for a, b in zip(tensors, plain, strict=True))
    return same, counted.calls, one_bucket.calls


def test_fused_equals_one_by_one_and_groups_dtypes() -> None:
    for same, small_cap_calls, calls in run_on_ranks(_fused_vs_plain, 3):
        assert same
        assert small_cap_calls > calls
        assert calls == 3  # float32, float64 and int64 buckets


def test_bucket_plan_respects_cap_and_dtype() -> None:
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(100),
          torch.zeros(1)]
    assert comm.plan_buckets(ts, cap_bytes=32) == [[0, 1], [2], [3], [4]]
    assert comm.plan_buckets(ts, cap_bytes=10_000) == [[0, 1, 3, 4], [2]]
    with pytest.raises(ValueError, match="positive"):
        comm.plan_buckets(ts, cap_bytes=0)


def _counted() -> tuple[int, int, float, int]:
    n = metadist.world().world_size
    stats.reset()
    comm.all_reduce(torch.zeros(256))
    comm.all_reduce(torch.zeros(256))
    out = torch.empty(8 * n)
    comm.all_gather(out, torch.zeros(8))
    snap = stats.snapshot()
    ar = snap.ops["all_reduce"]
    return ar.calls, ar.bytes, ar.wire_bytes, snap.ops["all_gather"].bytes


def test_counters_record_calls_and_ring_bytes() -> None:
    for calls, nbytes, wire, gathered in run_on_ranks(_counted, 4):
        assert (calls, nbytes, gathered) == (2, 2 * 1024, 8 * 4 * 4)
        assert wire == pytest.approx(2 * 2 * 1024 * 3 / 4)


def _errors() -> list[str]:
    messages = []
    for call in (
        lambda: comm.all_reduce(torch.ones(1), "avg"),  # type: ignore[arg-type]
        lambda: comm.all_gather(torch.empty(3), torch.ones(1)),
        lambda: comm.reduce_scatter(torch.empty(2), torch.ones(3)),
        lambda: comm.all_gather(torch.empty(2, device="meta"), torch.ones(1)),
        lambda: comm.functional.all_reduce(torch.ones(1), "max"),  # type: ignore[arg-type]
    ):
        try:
            call()
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_user_errors_say_what_to_do() -> None:
    messages = run_on_ranks(_errors, 2)[0]
    assert "choose one of: sum, mean, max, min, prod" in messages[0]
    assert "must be (2*1" in messages[1]
    assert "must be (2*2" in messages[2]
    assert "different devices" in messages[3]
    assert "choose sum or mean" in messages[4]


def _skip_a_collective() -> None:
    comm.set_debug(True)
    try:
        if metadist.world().rank != 1:
            comm.all_reduce(torch.ones(3))
        comm.broadcast(torch.ones(3))
    finally:
        comm.set_debug(False)


def test_debug_mode_turns_a_skipped_collective_into_an_error() -> None:
    with pytest.raises(metadist.RankFailedError, match="collective mismatch"):
        run_on_ranks(_skip_a_collective, 2, timeout=60)


def _large_reduce_scatter() -> tuple[bool, bool, bool, int, int]:
    """Inputs above the ring threshold take the point-to-point ring on gloo (its calls are
    counted); a small one takes the in-place all-reduce."""
    from metadist.comm import ring

    r, n = metadist.world().rank, metadist.world().world_size
    m = (1 << 20) // 4 // n + 7  # > 1 MiB in total, an odd chunk length
    x = torch.arange(n * m, dtype=torch.float32) * (r + 1)
    keep = x.clone()
    out = torch.empty(m)
    rings = [0]
    original = ring.reduce_scatter

    def counted(*args: object, **kwargs: object) -> object:
        rings[0] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    ring.reduce_scatter = counted  # type: ignore[assignment]
    try:
        handle = comm.reduce_scatter(out, x, "mean", async_op=True)
        handle.wait()
        expected = torch.arange(r * m, (r + 1) * m, dtype=torch.float32) * sum(
            k + 1 for k in range(n)) / n
        scratch = x.clone()
        out2 = torch.empty(m)
        comm.reduce_scatter(out2, scratch, "sum", input_is_scratch=True)
        large = rings[0]
        comm.reduce_scatter(torch.empty(2), torch.ones(2 * n), "sum")
    finally:
        ring.reduce_scatter = original  # type: ignore[assignment]
    return (torch.allclose(out, expected), torch.equal(x, keep),
            torch.allclose(out2, expected * n), large, rings[0] - large)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_reduce_scatter_on_large_inputs(n: int) -> None:
    for close, untouched, scratch_close, rings, small_rings in run_on_ranks(
            _large_reduce_scatter, n):
        assert close and untouched and scratch_close
        assert (rings, small_rings) == (2, 0)  # both large calls ran the ring, the small none


def _two_rank_paths(impl: str) -> tuple[dict[str, int], list[float], list[float]]:
    """Which ring functions a two-rank all_gather and reduce call (counted), and their
    values."""
    from metadist.comm import ring

    r = metadist.world().rank
    calls = {"all_gather": 0, "reduce_to": 0}
    originals = {name: getattr(ring, name) for name in calls}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in calls:
        setattr(ring, name, counting(name))
    try:
        gathered = torch.empty(4)
        comm.all_gather(gathered, torch.tensor([r, 10.0 + r]), impl=impl)  # type: ignore[arg-type]
        reduced = torch.tensor([r + 1.0])
        comm.reduce(reduced, dst=0, op="sum", impl=impl)  # type: ignore[arg-type]
    finally:
        for name, fn in originals.items():
            setattr(ring, name, fn)
    return calls, gathered.tolist(), reduced.tolist()


def test_two_rank_all_gather_and_reduce_are_one_exchange_on_gloo() -> None:
    """README: on gloo, point-to-point rings for two-rank all-gather and reduce; native
    collectives when asked."""
    for impl, used in (("auto", 1), ("native", 0)):
        for r, (calls, gathered, reduced) in enumerate(run_on_ranks(_two_rank_paths, 2,
                                                                     args=(impl,))):
            assert calls == {"all_gather": used, "reduce_to": used}, (impl, r)
            assert gathered == [0.0, 10.0, 1.0, 11.0]
            if r == 0:
                assert reduced == [3.0]


def _empty_rows() -> tuple[list[int], list[int]]:
    full = torch.empty(0)
    comm.all_gather(full, torch.empty(0))
    piece = torch.empty(0)
    comm.reduce_scatter(piece, torch.empty(0))
    return list(full.shape), list(piece.shape)


def test_empty_tensors_pass_through_the_gloo_algorithms() -> None:
    assert run_on_ranks(_empty_rows, 2) == [([0], [0]), ([0], [0])]


def _parts_reduce_scatter() -> tuple[bool, bool, bool, int]:
    """A reduce-scatter of parts equals the one of their concatenation bit for bit (the ring
    adds in the same order), leaves the parts alone, and its differentiable form hands each
    part its slice of the gathered gradient."""
    from metadist.comm import functional, ring

    r, n = metadist.world().rank, metadist.world().world_size
    g = torch.Generator().manual_seed(10 + r)
    rings = [0]
    original = ring.reduce_scatter_parts

    def counted(*args: Any, **kwargs: Any) -> Any:
        rings[0] += 1
        return original(*args, **kwargs)

    ring.reduce_scatter_parts = counted  # type: ignore[assignment]
    equal, untouched = True, True
    try:
        for m in ((1 << 20) // 4 // n + 7, 5):  # the ring (odd chunks), then the small path
            total = n * m
            # boundaries inside chunks, a one-element part, a part spanning several chunks
            sizes = [3, 1, m - 2]
            rest = total - sum(sizes)
            sizes += [rest - 5, 4, 1] if rest > 5 else [rest]
            parts = [torch.randn(s, generator=g) for s in sizes]
            keep = [p.clone() for p in parts]
            out, ref = torch.empty(m), torch.empty(m)
            comm.reduce_scatter(ref, torch.cat(parts), "sum")
            comm.ops.reduce_scatter_parts(out, parts, "sum")
            equal = equal and torch.equal(out, ref)
            untouched = untouched and all(torch.equal(a, b) for a, b in zip(parts, keep,
                                                                            strict=True))
    finally:
        ring.reduce_scatter_parts = original  # type: ignore[assignment]
    leaves = [torch.randn(s, generator=g, requires_grad=True) for s in (7, 5 * n - 7, n)]
    out = functional.reduce_scatter_parts([leaf * 1.0 for leaf in leaves])
    w = torch.arange(float(out.numel())) + r
    grads = torch.autograd.grad((out * w).sum(), leaves)
    every = torch.empty(n * out.numel())
    comm.all_gather(every, w)
    slices = every.split([leaf.numel() for leaf in leaves])
    return equal, untouched, all(torch.equal(a, b) for a, b in zip(grads, slices,
                                                                    strict=True)), rings[0]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter_of_parts_equals_the_concatenations(n: int) -> None:
    for equal, untouched, grads, rings in run_on_ranks(_parts_reduce_scatter, n):
        assert equal and untouched and grads
        assert rings == 1  # the large call ran the ring, the small one the concatenation
