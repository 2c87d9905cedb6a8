"""init/world/launch/shutdown, sub-groups and the rank helpers, on real processes."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading

import pytest
import torch

import metadist
from metadist import comm
from metadist.runtime import world as world_mod
from metadist.testing import run_on_ranks


def _world_fields() -> tuple[int, int, int, int, int, int, str, str, str]:
    w = metadist.world()
    return (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank, w.num_nodes,
            w.backend, str(w.device), w.launcher)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_world_on_every_rank(n: int) -> None:
    fields = run_on_ranks(_world_fields, n)
    backend = "none" if n == 1 else "gloo"
    assert fields == [(r, n, r, n, 0, 1, backend, "cpu", "launch") for r in range(n)]


def _init_twice() -> bool:
    return metadist.init() is metadist.init() and metadist.is_initialized()


def test_init_is_idempotent() -> None:
    assert run_on_ranks(_init_twice, 2) == [True, True]


def test_single_process_world_opens_no_process_group() -> None:
    assert not metadist.is_initialized()
    with pytest.raises(metadist.NotInitializedError, match=r"call metadist\.init\(\) first"):
        metadist.world()
    w = metadist.init()
    try:
        assert (w.world_size, w.backend, w.launcher) == (1, "none", "single")
        assert not torch.distributed.is_initialized()
        t = torch.tensor([2.0])
        comm.all_reduce(t, "mean")
        assert t.item() == 2.0  # a world of one: every collective is the identity
    finally:
        metadist.shutdown()
    metadist.shutdown()  # twice is fine
    assert not metadist.is_initialized()


def test_collective_before_init_names_the_fix() -> None:
    with pytest.raises(metadist.NotInitializedError, match=r"metadist\.init"):
        comm.all_reduce(torch.ones(1))


def _hybrid_layout() -> tuple[int, int, list[float], list[float]]:
    w = metadist.world()
    x = torch.tensor([float(w.rank)])
    within = x.clone()
    comm.all_reduce(within, group=metadist.node_group())
    across = x.clone()
    comm.all_reduce(across, group=metadist.cross_node_group())
    return w.node_rank, w.local_rank, within.tolist(), across.tolist()


def test_two_simulated_nodes_have_node_and_cross_node_groups() -> None:
    # ranks 0,1 on node 0 and 2,3 on node 1
    out = run_on_ranks(_hybrid_layout, 4, nnodes=2)
    assert out == [(0, 0, [1.0], [2.0]), (0, 1, [1.0], [4.0]),
                   (1, 0, [5.0], [2.0]), (1, 1, [5.0], [4.0])]


def _one_node_groups() -> tuple[bool, bool]:
    return metadist.node_group() is None, metadist.cross_node_group() is metadist.SELF


def test_one_node_degenerates_to_world_and_self() -> None:
    assert run_on_ranks(_one_node_groups, 2) == [(True, True), (True, True)]


def _adopt_user_group(port: int) -> tuple[str, int]:
    # A process group the user created before metadist.init is adopted, not replaced.
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}",
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        w = metadist.init()
        t = torch.ones(1)
        comm.all_reduce(t)
        return w.launcher, int(t.item())
    finally:
        metadist.shutdown()
        torch.distributed.destroy_process_group()


def _spawned_adopt(port: int) -> tuple[str, int]:
    metadist.shutdown()  # leave the group launch() created, join the user's own
    return _adopt_user_group(port)


def test_adopts_a_process_group_the_user_created() -> None:
    port = metadist.runtime.spawn.free_port()
    assert metadist.launch(_spawned_adopt, 2, args=(port,), timeout=60) == [("launch", 2)] * 2


# ----- launch: results, failures, hangs, cleanup -------------------------------------------

def _rank_square(offset: int, *, scale: int = 1) -> int:
    return (metadist.world().rank + offset) ** 2 * scale


def test_launch_returns_results_in_rank_order() -> None:
    assert metadist.launch(_rank_square, 3, args=(1,), kwargs={"scale": 2}) == [2, 8, 18]


def _fail_on_rank_one() -> None:
    if metadist.world().rank == 1:
        raise ValueError("deliberate failure on rank 1")
    comm.barrier()  # rank 0 and 2 would wait forever for rank 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _new_children(before: set[multiprocessing.process.BaseProcess]) -> list[object]:
    return [p for p in multiprocessing.active_children() if p not in before]


def test_failure_names_the_rank_fast_and_leaves_no_process() -> None:
    before = set(multiprocessing.active_children())  # pools kept by run_on_ranks
    # No clock: the others' collective limit (300 s) is past the job's 120 s, so a failure
    # seen only through a timeout would be a LaunchTimeoutError; and none of them timed out.
    with (metadist.RankPool(3, timeout=120, collective_timeout=300) as pool,
          pytest.raises(metadist.RankFailedError) as info):
        pool.run(_fail_on_rank_one, timeout=120)
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "_fail_on_rank_one" in info.value.remote_traceback
    assert not any("Timeout" in line for line in info.value.others.values()), info.value.others
    assert _new_children(before) == []


def _hang_on_rank_two() -> None:
    comm.barrier()  # every rank is inside this function before the timeout can matter
    if metadist.world().rank == 2:
        threading.Event().wait()  # hangs for good (never set)
    comm.barrier()


def test_hang_is_reported_with_the_stuck_ranks_stack() -> None:
    # Deterministic under load: start-up has its own generous limit (only the job's 8 s may
    # expire), the first barrier puts rank 2 inside the function whatever the scheduling, and
    # the parent waits for each rank's answer that its stacks were written (no fixed sleep).
    before = set(multiprocessing.active_children())
    with metadist.RankPool(3, timeout=120) as pool, \
            pytest.raises(metadist.LaunchTimeoutError) as info:
        pool.run(_hang_on_rank_two, timeout=8)
    assert info.value.ranks == [0, 1, 2]
    assert "_hang_on_rank_two" in info.value.stacks[2], info.value.stacks
    assert "_hang_on_rank_two" in info.value.stacks[0], info.value.stacks
    assert _new_children(before) == []


def _exit_hard() -> None:
    if metadist.world().rank == 0:
        os._exit(3)
    comm.barrier()


def test_a_rank_that_dies_without_raising_is_reported() -> None:
    with pytest.raises(metadist.RankFailedError, match="rank 0 exited unexpectedly"):
        metadist.launch(_exit_hard, 2, timeout=60)


def _unpicklable() -> object:
    return lambda: None


def test_unpicklable_result_is_an_error_not_a_hang() -> None:
    with pytest.raises(metadist.RankFailedError, match="could not be sent back"):
        metadist.launch(_unpicklable, 1, timeout=60)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nprocs must be >= 1"):
        metadist.launch(_rank_square, 0)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        metadist.launch(_rank_square, 3, nnodes=2)


# ----- rank helpers ------------------------------------------------------------------------

@metadist.rank_zero_only
def _zero() -> str:
    return "zero"


@metadist.rank_non_zero_only
def _non_zero() -> str:
    return "non-zero"


@metadist.on_rank(1, 2)
def _one_or_two() -> int:
    return metadist.world().rank


@metadist.not_on_rank(1)
def _not_one() -> int:
    return metadist.world().rank


def _helpers() -> tuple[object, ...]:
    return _zero(), _non_zero(), _one_or_two(), _not_one()


def test_rank_decorators() -> None:
    assert run_on_ranks(_helpers, 3) == [
        ("zero", None, None, 0), (None, "non-zero", 1, None), (None, "non-zero", 2, 2)]


def _print_and_log() -> list[object]:
    metadist.print(f"printed-by-rank-{metadist.world().rank}")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = metadist.get_logger("test")
    keep = Keep()
    log.addHandler(keep)
    log.warning("hello")
    log.removeHandler(keep)
    return [getattr(r, "rank", None) for r in records]


def test_rank_zero_print_and_logger_carry_the_rank(capfd: pytest.CaptureFixture[str]) -> None:
    # Fresh processes (not a cached pool) so their output lands in this test's capture.
    assert metadist.launch(_print_and_log, 2, timeout=60) == [[0], [1]]
    out = capfd.readouterr()
    assert "printed-by-rank-0" in out.out and "printed-by-rank-1" not in out.out
    assert "rank 0] WARNING metadist.test: hello" in out.err
    assert "rank 1] WARNING metadist.test: hello" in out.err


def test_decorators_read_the_launcher_environment_before_init(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert not world_mod.is_initialized()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _zero() is None and _non_zero() == "non-zero"
    with pytest.raises(ValueError, match="at least one rank"):
        metadist.on_rank()


def _write_in_place(t: torch.Tensor) -> list[float]:
    t.add_(metadist.world().rank + 1)  # each rank writes its own copy...
    comm.barrier()
    return t.tolist()  # ...and must not see the other ranks' writes


def test_tensors_cross_launch_by_value_never_shared() -> None:
    t = torch.zeros(2)
    out = metadist.launch(_write_in_place, 2, args=(t,))
    assert out == [[1.0, 1.0], [2.0, 2.0]]
    assert t.tolist() == [0.0, 0.0]
