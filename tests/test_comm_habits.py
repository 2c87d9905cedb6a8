"""RAF's and torch's collective habits in metadist.comm.

Reproduction (issue 44, RAF): ``x = comm.all_reduce(x)`` made ``x`` a Handle (``x + 1``
raised TypeError), ``comm.all_reduce([x])`` raised ``AttributeError: 'list' object has no
attribute 'numel'``, the world had no ``root_rank`` and ``comm`` no send/recv. Now each
collective returns its result (a handle only with ``async_op=True``), lists are reduced
fused, ``metadist.world().root_rank`` is 0, and ``send``/``recv``/``isend``/``irecv`` move
tensors between two ranks under the collectives' bounded waits and debug checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import metadist
from metadist import comm
from metadist.comm import stats
from metadist.testing import run_on_ranks


def _results() -> dict[str, Any]:
    w = metadist.world()
    x = torch.full((3,), float(w.rank + 1))
    x = comm.all_reduce(x)
    y = x + 1  # a tensor, not a handle
    b = comm.broadcast(torch.full((2,), float(w.rank)), 1)
    out = comm.all_gather(torch.empty(w.world_size, 2), torch.full((1, 2), float(w.rank)))
    r = comm.reduce(torch.ones(2), 0)
    handle = comm.all_reduce(torch.ones(2), async_op=True)
    return {"x": x.tolist(), "y": y.tolist(), "b": b.tolist(), "gathered": out[:, 0].tolist(),
            "reduced": r.tolist() if w.rank == 0 else None,
            "handle": type(handle).__name__, "waited": handle.wait().tolist(),
            "root_rank": w.root_rank}


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_return_their_tensor_and_a_handle_only_when_asked(n: int) -> None:
    total = n * (n + 1) / 2
    for rank, out in enumerate(run_on_ranks(_results, n)):
        assert out["x"] == [total] * 3 and out["y"] == [total + 1] * 3
        assert out["b"] == [1.0, 1.0]
        assert out["gathered"] == [float(r) for r in range(n)]
        assert out["reduced"] == ([float(n)] * 2 if rank == 0 else None)
        assert out["handle"] == "Handle" and out["waited"] == [float(n)] * 2
        assert out["root_rank"] == 0


def _fused_list() -> dict[str, Any]:
    w = metadist.world()
    tensors = [torch.full((i % 3 + 1,), float(w.rank + i)) for i in range(200)]
    with stats.counting() as counted:
        out = comm.all_reduce(tensors)
    single = comm.all_reduce((torch.ones(1), torch.ones(2, dtype=torch.float64)))
    return {"same": all(a is b for a, b in zip(out, tensors, strict=True)),
            "values": [t[0].item() for t in out[:3]],
            "single": [t.tolist() for t in single], "calls": counted.calls}


def test_a_list_is_reduced_fused_in_place() -> None:
    for out in run_on_ranks(_fused_list, 2):
        assert out["same"]
        assert out["values"] == [1.0, 3.0, 5.0]  # (rank 0 + i) + (rank 1 + i)
        assert out["single"] == [[2.0], [2.0, 2.0]]
        assert out["calls"] == 1  # 200 tensors of one dtype: one collective


def _point_to_point() -> dict[str, Any]:
    w = metadist.world()
    n = w.world_size
    right, left = (w.rank + 1) % n, (w.rank - 1) % n
    mine = torch.full((4,), float(w.rank))
    got = torch.empty(4)
    if w.rank % 2 == 0:  # a ring, ordered so that blocking calls pair
        comm.send(mine, right)
        comm.recv(got, left)
    else:
        comm.recv(got, left)
        comm.send(mine, right)
    a, b = torch.full((2,), float(w.rank)), torch.empty(2)
    handles = [comm.isend(a, right), comm.irecv(b, left)]
    received = handles[1].wait()
    handles[0].wait()
    comm.barrier()  # the group's collectives still pair after point-to-point traffic
    return {"got": got.tolist(), "irecv": received.tolist(), "same": received is b}


@pytest.mark.parametrize("n", [2, 3])
def test_send_and_recv_between_ranks(n: int) -> None:
    for rank, out in enumerate(run_on_ranks(_point_to_point, n)):
        left = float((rank - 1) % n)
        assert out["got"] == [left] * 4 and out["irecv"] == [left] * 2 and out["same"]


def _mismatched_recv() -> str:
    comm.set_debug(True)
    try:
        if metadist.world().rank == 0:
            comm.send(torch.ones(3), 1)
        else:
            comm.recv(torch.empty(2, 2), 0)
    except metadist.errors.CollectiveMismatchError as e:
        return str(e)
    finally:
        comm.set_debug(False)
    return "no error"


def test_debug_mode_names_a_recv_of_another_shape_on_both_sides() -> None:
    for message in run_on_ranks(_mismatched_recv, 2):
        assert "the sender sends a torch.float32 of shape (3,)" in message, message
        assert "the receiver receives into a torch.float32 of shape (2, 2)" in message, message


def _to_itself() -> str:
    try:
        comm.send(torch.ones(1), metadist.world().rank)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_send_to_itself_is_named() -> None:
    assert "is not another rank of the group" in run_on_ranks(_to_itself, 2)[0]


def _both_receive() -> None:
    comm.recv(torch.empty(2), 1 - metadist.world().rank)


def test_two_ranks_that_both_receive_stop_within_the_collective_timeout_naming_it() -> None:
    """The same bounded wait as the collectives (the watchdog's limit, 5 s here), and the
    explanation a point-to-point deadlock needs."""
    with metadist.RankPool(2, timeout=120, collective_timeout=5) as pool, \
            pytest.raises(metadist.RankFailedError) as info:
        pool.run(_both_receive, timeout=120)
    text = str(info.value)
    assert "recv #1 on the point-to-point pair of ranks 0 and 1 did not complete" in text, text
    assert "is in recv #1 too: both ranks receive" in text, text
