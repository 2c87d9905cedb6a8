"""Operability: no collective waits forever, a stuck one names its op, call number and the
missing ranks; debug mode catches diverging calls; one rank's failure fails the job with the
origin shown once; one-node jobs listen on loopback only. Hang tests use 3 s timeouts."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import metadist
from metadist import comm
from metadist.comm import debug
from metadist.errors import CollectiveMismatchError, RankFailedError, RendezvousError
from metadist.runtime import failures, rendezvous, watchdog
from metadist.runtime.env import detect
from metadist.runtime.progress import Progress, Published, explain
from metadist.runtime.spawn import free_port
from metadist.runtime.tracker import CollectiveCall, GroupInfo, compact_ranks, configure_debug
from metadist.testing import is_loopback_address, listening_addresses, run_on_ranks

TIMEOUT = 3.0  # the collective timeout of the hang tests


def _new_children(before: set[multiprocessing.process.BaseProcess]) -> list[object]:
    return [p for p in multiprocessing.active_children() if p not in before]


def _launch_failing(fn: object, nprocs: int) -> RankFailedError:
    """The error of a job that must fail. No clock: a job that waited for launch()'s own
    120 s limit would raise LaunchTimeoutError instead, and each test checks which collective
    error (a timeout at TIMEOUT, or a lost peer seen at once) stopped it."""
    before = set(multiprocessing.active_children())
    with pytest.raises(RankFailedError) as info:
        metadist.launch(fn, nprocs, collective_timeout=TIMEOUT, timeout=120,  # type: ignore[arg-type]
                        threads=1)
    assert _new_children(before) == [], "a rank outlived launch()"
    return info.value


# ----- the watchdog: skipped collective, dead rank, rank hanging in user code ---------------

def _skip_second_all_reduce() -> None:
    t = torch.ones(3)
    comm.all_reduce(t)
    if metadist.world().rank != 1:
        comm.all_reduce(t)  # #2: rank 1 never comes


def test_a_skipped_collective_times_out_naming_op_call_and_rank() -> None:
    err = _launch_failing(_skip_second_all_reduce, 2)
    # The origin is the rank that did not arrive; rank 0 waited for it and reported.
    assert (err.rank, err.reported_by, err.exc_type) == (1, 0, "CollectiveTimeoutError")
    assert "all_reduce #2 on the world group did not complete within 3 s" in str(err)
    assert "rank 1 did not arrive (last collective on this group: #1 all_reduce)" in str(err)
    assert str(err).startswith("rank 1 did not arrive (rank 0 waited for it): it returned "
                               "from the function without making that call")
    assert "METADIST_TIMEOUT" in str(err)
    assert "_skip_second_all_reduce" in err.remote_traceback  # where rank 0 was waiting


def _watchdog_report_without_rank_variable(path: str) -> str:
    """The watchdog's report as a program that set up its process group itself prints it:
    no ``RANK`` in the environment (``mp.spawn`` passes the rank as an argument)."""
    rank, saved_env = metadist.world().rank, os.environ.pop("RANK", None)
    out = f"{path}.{rank}"
    fd, saved_fd = os.open(out, os.O_WRONLY | os.O_CREAT), os.dup(2)
    os.dup2(fd, 2)
    try:
        watchdog._print_and_record(watchdog.Report(
            "CollectiveTimeoutError", "all_reduce #2 did not complete", "  in step()\n",
            secondary=False))
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(fd)
        if saved_env is not None:
            os.environ["RANK"] = saved_env
    with open(out) as f:
        return f.read()


def test_a_watchdog_report_names_the_rank_without_a_rank_variable(tmp_path: Path) -> None:
    out = run_on_ranks(_watchdog_report_without_rank_variable, 2, args=(str(tmp_path / "err"),))
    for rank, text in enumerate(out):
        assert text.startswith(f"[rank {rank}] metadist watchdog: all_reduce #2"), text
        assert f"--- where rank {rank} was ---" in text, text


def _die_between_collectives() -> None:
    t = torch.ones(3)
    comm.all_reduce(t)
    if metadist.world().rank == 1:
        os._exit(3)
    comm.all_reduce(t)


def test_a_rank_that_dies_mid_step_is_the_origin_and_the_others_say_why() -> None:
    err = _launch_failing(_die_between_collectives, 2)
    assert err.rank == 1 and "rank 1 exited unexpectedly (exit code 3)" in str(err)
    # The survivor's error is secondary: one line, naming the op, the call and the lost rank.
    assert list(err.others) == [0], "the survivor did not explain the lost peer"
    assert "CollectiveFailedError: all_reduce #2 on the world group failed" in err.others[0]
    assert "rank 1 did not arrive" in err.others[0]
    # The peer loss is seen at once, not after a timeout.
    assert "CollectiveTimeoutError" not in err.others[0]


def _hang_in_user_code() -> None:
    t = torch.ones(3)
    comm.all_reduce(t)
    if metadist.world().rank == 1:
        time.sleep(600)
    comm.all_reduce(t)


def test_a_rank_hanging_in_user_code_stops_every_rank_within_the_timeout() -> None:
    err = _launch_failing(_hang_in_user_code, 2)
    assert (err.rank, err.reported_by, err.exc_type) == (1, 0, "CollectiveTimeoutError")
    assert "all_reduce #2 on the world group did not complete within 3 s" in str(err)
    assert "rank 1 did not arrive" in str(err)
    # The hung rank says where it was (its watchdog saw rank 0's report), in the first line.
    first = str(err).splitlines()[0]
    assert first.startswith("rank 1 did not arrive (rank 0 waited for it): ")
    assert "not in a collective: it was at" in first and "_hang_in_user_code" in first


def _abandon_async_handles() -> list[float]:
    t = torch.ones(3)
    n = metadist.world().world_size
    out, full = torch.empty(1 << 18), torch.ones(n << 18)
    # Issued, kept, never waited (e.g. a prefetch nobody needed): nobody is blocked on them.
    kept = [comm.all_reduce(t, async_op=True),
            comm.reduce_scatter(out, full, async_op=True)]  # a point-to-point ring on gloo
    time.sleep(2.5)  # well past the 1 s timeout
    u = torch.ones(2)
    comm.all_reduce(u)
    del kept
    return u.tolist()


def test_async_handles_nobody_waits_for_are_not_hangs() -> None:
    out = metadist.launch(_abandon_async_handles, 2, collective_timeout=1.0, timeout=120,
                          threads=1)
    assert out == [[2.0, 2.0]] * 2


def _ring_on_a_sub_group_then_the_world() -> list[float]:
    sub = torch.distributed.new_group([0, 1])
    if metadist.world().rank in (0, 1):
        out = torch.empty(4)
        comm.all_gather(out, torch.ones(2), group=sub)  # a two-rank ring on gloo
    n = metadist.world().world_size
    piece = torch.empty(1 << 18)
    comm.reduce_scatter(piece, torch.ones(n << 18))  # a world ring (> 1 MiB)
    return piece[:2].tolist()


def test_rings_on_a_sub_group_do_not_desynchronise_world_rings() -> None:
    # Ring tags used to come from one counter per process: rank 2 (not in the sub-group) then
    # tagged the world ring differently and every rank waited forever. Found by the watchdog.
    assert run_on_ranks(_ring_on_a_sub_group_then_the_world, 3) == [[3.0, 3.0]] * 3


def _every_op_then_what_is_left_waiting() -> list[str]:
    from metadist.runtime.tracker import TRACKER

    n = metadist.world().world_size
    for impl in ("auto", "native"):
        for async_op in (False, True):
            for rows in (1, 1 << 18):  # below and above the ring threshold
                comm.ops.reduce_scatter(torch.empty(rows), torch.ones(n * rows), impl=impl,
                                        async_op=async_op).wait()
                comm.ops.all_gather(torch.empty(n * rows), torch.ones(rows), impl=impl,
                                    async_op=async_op).wait()
            comm.ops.reduce(torch.ones(4), impl=impl, async_op=async_op).wait()
        comm.ops.all_reduce(torch.ones(4), async_op=async_op).wait()
        comm.ops.broadcast(torch.ones(4), async_op=async_op).wait()
    comm.barrier()
    return [f"{e.op} #{e.seq}" for e in TRACKER.waiting()]


@pytest.mark.parametrize("world", [2, 3])
def test_no_collective_is_left_waiting_after_it_returned(world: int) -> None:
    # gloo's reduce_scatter_tensor returns a work whose is_completed() stays False after its
    # wait(). The tracker trusted it, kept the entry "waiting", and the watchdog stopped a
    # healthy job one timeout later (seen twice in full test-suite runs).
    assert run_on_ranks(_every_op_then_what_is_left_waiting, world) == [[]] * world


# ----- one failure fails all, shown once ----------------------------------------------------

def _fail_inside_ddp_training() -> None:
    torch.manual_seed(0)
    s = metadist.strategy("ddp")
    net = nn.Linear(4, 2)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for step in range(4):
        opt.zero_grad()
        if step == 2 and metadist.world().rank == 1:
            raise ValueError("deliberate failure in rank 1's forward")
        s.backward(model(torch.randn(8, 4)).pow(2).mean())  # rank 0 waits in its all-reduce
        opt.step()


def test_a_failure_inside_a_strategy_fails_all_ranks_with_one_traceback() -> None:
    err = _launch_failing(_fail_inside_ddp_training, 2)
    assert (err.rank, err.exc_type) == (1, "ValueError")
    assert str(err).count("Traceback (most recent call last)") == 1
    assert "_fail_inside_ddp_training" in err.remote_traceback
    # Rank 0, blocked in its all-reduce, is listed too, whether it reported or was stopped.
    assert list(err.others) == [0], err.others
    assert "CollectiveTimeoutError" not in err.others[0]  # stopped at once, not timed out


# ----- debug mode -----------------------------------------------------------------------------

def _diverge() -> list[tuple[str, bool]]:
    """Three ways to diverge, each caught before the real collective runs (so the group stays
    usable and the next scenario can run in the same processes)."""
    r = metadist.world().rank
    comm.set_debug(True)
    caught = []
    scenarios = [
        lambda: comm.all_reduce(torch.ones(3)) if r != 1 else comm.broadcast(torch.ones(3)),
        lambda: comm.all_reduce(torch.ones(3, 2 if r == 2 else 4)),
        lambda: comm.all_reduce(torch.ones(2, dtype=torch.float64 if r == 0 else torch.float32)),
    ]
    sub = torch.distributed.new_group([1, 2])  # ranks are named globally on sub-groups too
    scenarios.append(lambda: None if r == 0 else comm.all_reduce(torch.ones(1), group=sub)
                     if r == 1 else comm.broadcast(torch.ones(1), group=sub))
    for scenario in scenarios:
        try:
            scenario()
            caught.append(("", False))
        except CollectiveMismatchError as err:
            caught.append((str(err), err.secondary))
    t = torch.full((2,), float(r))
    comm.all_reduce(t)  # still in step: the matching call goes through
    comm.set_debug(False)
    caught.append((str(t.tolist()), False))
    return caught


def test_debug_mode_names_the_op_the_differing_field_and_the_ranks() -> None:
    out = run_on_ranks(_diverge, 3, timeout=120)
    op, shape, dtype, on_group, after = zip(*out, strict=True)
    for i, (text, _) in enumerate(op):
        assert "collective mismatch at call #" in text
        assert "op: all_reduce on ranks 0, 2; broadcast on rank 1" in text
        assert op[i][1] == (i != 1), "only the rank that differs is the origin"
    assert "shape: (3, 4) on ranks 0, 1; (3, 2) on rank 2" in shape[0][0]
    assert [s for _, s in shape] == [True, True, False]
    assert "dtype: float64 on rank 0; float32 on ranks 1, 2" in dtype[0][0]
    assert on_group[0] == ("", False)
    assert "(ranks 1, 2)" in on_group[1][0]
    assert "op: all_reduce on rank 1; broadcast on rank 2" in on_group[1][0]
    assert [s for _, s in on_group[1:]] == [True, False]
    assert all(text == "[3.0, 3.0]" for text, _ in after)


def test_debug_mode_is_off_by_default_and_set_by_env_or_init_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # What init(debug=...) runs; init itself may already have run in this test process.
    assert not comm.debug_enabled(), "debug mode is off by default"
    try:
        monkeypatch.setenv("METADIST_DEBUG", "1")
        configure_debug(None)
        assert comm.debug_enabled()
        configure_debug(False)  # an explicit init option wins over the environment
        assert not comm.debug_enabled()
        monkeypatch.setenv("METADIST_DEBUG", "0")
        configure_debug(None)
        assert not comm.debug_enabled()
        configure_debug(True)
        assert comm.debug_enabled()
    finally:
        comm.set_debug(False)


def test_fingerprints_round_trip() -> None:
    row = debug.encode(7, "reduce_scatter", "mean", -1,
                       [(torch.zeros(2, 3, dtype=torch.bfloat16), True), (torch.zeros(5), False)])
    assert len(row) == debug.WIDTH
    fp = debug.decode(row)
    assert (fp.op, fp.seq, fp.reduce, fp.root) == ("reduce_scatter", 7, "mean", -1)
    assert fp.dtypes == ("bfloat16", "float32") and fp.shapes == ("(2, 3)", "(any)")


# ----- init, configuration, messages ----------------------------------------------------------

def test_rendezvous_that_never_completes_fails_within_the_timeout() -> None:
    # What init(timeout=1) runs for rank 0 alone, then for rank 1 alone, of a world of two.
    port = str(free_port())
    for rank, expected in (("0", "waited 1 s at 127.0.0.1"), ("1", "could not reach")):
        detected = detect({"RANK": rank, "WORLD_SIZE": "2", "MASTER_PORT": port})
        with pytest.raises(RendezvousError, match=expected) as info:
            rendezvous.join(detected, "gloo", torch.device("cpu"), 1.0)
        assert "MASTER_ADDR" in str(info.value) or "MASTER_PORT" in str(info.value)


def test_timeout_comes_from_init_then_environment_then_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("METADIST_TIMEOUT", raising=False)
    assert watchdog.resolve_timeout(None) == watchdog.DEFAULT_TIMEOUT_S == 300
    monkeypatch.setenv("METADIST_TIMEOUT", "12.5")
    assert watchdog.resolve_timeout(None) == 12.5
    assert watchdog.resolve_timeout(4) == 4.0
    monkeypatch.setenv("METADIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"METADIST_TIMEOUT='soon' is not a number of seconds"):
        watchdog.resolve_timeout(None)
    with pytest.raises(ValueError, match="positive"):
        watchdog.resolve_timeout(-1)
    config = watchdog.WatchdogConfig.for_timeout(300)
    assert (config.tick, config.grace) == (1.0, 2.0)
    assert watchdog.backstop(300) > 300


def test_missing_ranks_are_named_compactly() -> None:
    group = GroupInfo("0", tuple(range(6)), "the world group")
    entry = CollectiveCall(group, 5, "all_gather")
    states: dict[int, tuple[int, str] | None] = {
        0: (5, "all_gather"), 1: (4, "broadcast"), 2: (4, "broadcast"), 3: (4, "broadcast"),
        4: None, 5: (5, "barrier")}
    text, missing = explain(entry, states, 0, Progress(None, "here"))
    assert missing == (1, 2, 3, 4)
    assert "ranks 1-3 did not arrive (last collective on this group: #4 broadcast)" in text
    assert "rank 4 did not arrive and published no progress" in text
    assert "rank 5 entered barrier as #5 instead" in text
    assert compact_ranks([7, 0, 1, 2, 4, 5]) == "0-2, 4, 5, 7"
    text, stuck = explain(entry, None, 0, Progress(None, "127.0.0.1:1"))
    assert "lost the store at 127.0.0.1:1" in text and "cannot be asked" in text
    assert stuck == ()
    # the store's host is rank 3: it is the one this rank waits for
    text, stuck = explain(entry, None, 0, Progress(None, "127.0.0.1:1", host_rank=3))
    assert "rank 3 did not arrive and cannot be asked: the store its process hosts" in text
    assert stuck == (3,)


def test_a_rank_past_the_stuck_call_is_named_as_a_diverged_program() -> None:
    """A rank that ran this call number as another op and went on (its async reductions
    issued further) published its recent ops: it is named as diverged, not as a network
    problem. One past by more than it kept is named as past the call."""
    entry = CollectiveCall(GroupInfo("0", (0, 1, 2, 3), "the world group"), 18, "broadcast")
    states = {1: Published(20, "reduce", ("reduce", "reduce", "broadcast")),
              2: Published(19, "broadcast", ("broadcast",)),
              3: Published(60, "all_reduce", ("all_reduce",) * 15)}
    text, missing = explain(entry, states, 0, Progress(None, "here"))
    assert "rank 1 entered reduce as #18 instead: the ranks' programs diverged" in text
    assert "rank 2" not in text  # it entered broadcast #18 too
    assert "rank 3 is already past this call (at #60 all_reduce) while it never completed " \
           "here: the ranks' programs diverged" in text
    assert "backend or network" not in text and missing == ()


def _failure(code: int, message: object, timestamp: int = 100) -> SimpleNamespace:
    return SimpleNamespace(exitcode=code, message=message, timestamp=timestamp)


def _report(summary: str, *, secondary: bool, printed: bool, when: float) -> dict[str, object]:
    return {"message": summary, "extraInfo": {"py_callstack": f"Traceback...\n{summary}",
            "timestamp": "100", "metadist": {"secondary": secondary, "printed": printed,
                                             "time": when}}}


def test_run_summary_names_the_origin_once() -> None:
    err = SimpleNamespace(failures={
        0: _failure(1, _report("CollectiveFailedError: all_reduce #2 ...", secondary=True,
                               printed=False, when=5.0)),
        1: _failure(1, _report("ValueError: boom", secondary=False, printed=True, when=6.0)),
        2: _failure(-15, "Signal 15 (SIGTERM) received by PID 9"),
        3: _failure(1, _report("ValueError: boom", secondary=True, printed=False, when=7.0)),
    })
    text = failures.summarize_run_failure(err, "train.py")
    origin = "  origin rank: 1 (exit code 1): ValueError: boom (printed above)"
    assert text.splitlines()[1] == origin
    assert "rank 0 stopped as a consequence (exit code 1): CollectiveFailedError" in text
    assert "rank 2 stopped as a consequence (killed by signal SIGTERM)" in text
    assert text.count("Traceback") == 0
    # A killed origin has no traceback; its file-less failure is still the origin.
    err = SimpleNamespace(failures={0: _failure(-9, "Signal 9 (SIGKILL) received by PID 3")})
    assert "origin rank: 0 (killed by signal SIGKILL)" in failures.summarize_run_failure(err, "t")


def test_secondary_errors_are_recognised() -> None:
    lost = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:16277")
    assert failures.is_secondary(lost) and not failures.is_secondary(ValueError("x"))
    assert failures.is_secondary(CollectiveMismatchError("m", secondary=True))


# ----- loopback ------------------------------------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_one_node_jobs_listen_on_loopback_only() -> None:
    # Fresh processes: pooled ones may carry listeners that other tests' code opened.
    per_rank = metadist.launch(listening_addresses, 2, timeout=120, threads=1)
    assert per_rank[0], "rank 0 should host the rendezvous store"
    for rank, addresses in enumerate(per_rank):
        assert all(map(is_loopback_address, addresses)), f"rank {rank} listens on {addresses}"


@pytest.mark.parametrize(("addr", "loopback"), [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("localhost", True),
    ("10.0.0.1", False), ("192.168.1.7", False), ("::ffff:10.0.0.1", False),
    ("no-such-host.invalid", False)])
def test_loopback_addresses_include_names_that_resolve_to_it(addr: str, loopback: bool) -> None:
    # torchrun --standalone hands workers MASTER_ADDR=localhost: pin gloo to lo there too.
    assert rendezvous.is_loopback(addr) is loopback
