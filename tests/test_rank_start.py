"""How launch() starts ranks: forked from a server that imported metadist once (Linux), with
the caller's environment and descriptors as they are at launch; spawned where a variable read
at process start differs; never outliving the caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import forkserver
from pathlib import Path

import pytest

import metadist
from metadist.runtime import rank_start, resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="ranks fork from a server on Linux only")
ROOT = Path(__file__).resolve().parents[1]


def _parent_and_env(*keys: str) -> tuple[int, dict[str, str | None]]:
    """The rank's parent and the variables asked for."""
    return os.getppid(), {k: os.environ.get(k) for k in keys}


def _server_pid() -> int | None:
    return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def test_ranks_fork_from_a_server_that_imported_metadist_once() -> None:
    first = metadist.launch(_parent_and_env, 2, threads=1)
    server = _server_pid()
    assert server is not None and server != os.getpid()
    assert [ppid for ppid, _ in first] == [server] * 2
    with open(f"/proc/{server}/cmdline", "rb") as f:  # the modules it imported before forking
        assert b"'metadist'" in f.read()
    again = metadist.launch(_parent_and_env, 3, threads=1)
    assert [ppid for ppid, _ in again] == [server] * 3, "one server serves every launch"


def test_a_rank_has_the_callers_environment_as_it_is_at_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    metadist.launch(_parent_and_env, 1)  # the server runs, started with the environment then
    monkeypatch.setenv("METADIST_TEST_SET_AFTER", "yes")
    monkeypatch.setenv("HOME", "/nowhere-else")  # a variable any rank may read at any time
    ranks = metadist.launch(_parent_and_env, 2, args=("METADIST_TEST_SET_AFTER", "HOME"),
                            threads=1)
    assert [env for _, env in ranks] == [
        {"METADIST_TEST_SET_AFTER": "yes", "HOME": "/nowhere-else"}] * 2


def test_a_variable_read_at_start_up_that_differs_starts_another_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """METADIST_ALLOCATOR acts when metadist is imported: a rank forked from the running
    server would keep its setting, so the ranks fork from a server started with the new one."""
    metadist.launch(_parent_and_env, 1)
    first = _server_pid()
    monkeypatch.setenv(resident.ENV, "default")
    ranks = metadist.launch(_resident_setting, 2, threads=1)
    second = _server_pid()
    assert second not in (first, None) and [ppid for ppid, _ in ranks] == [second] * 2
    assert all(words.startswith("glibc and torch defaults") for _, words in ranks), ranks
    monkeypatch.delenv(resident.ENV)
    ranks = metadist.launch(_resident_setting, 2, threads=1)
    assert _server_pid() not in (second, None)
    assert [ppid for ppid, _ in ranks] == [_server_pid()] * 2
    assert all(words.startswith("metadist's") for _, words in ranks), ranks


def test_ranks_state_the_allocator_setting_they_run_under() -> None:
    """A rank inherits the caller's huge-page variable (set by metadist's import there) and
    says that setting is in force, as the caller does."""
    assert "torch huge pages" in resident.setting()
    assert [words for _, words in metadist.launch(_resident_setting, 2, threads=1)] == [
        resident.setting()] * 2


def test_a_server_that_died_or_was_restarted_elsewhere_is_replaced() -> None:
    """A restart metadist did not make (multiprocessing restarts a dead server on its next
    start) has an environment metadist does not know: it starts its own again."""
    metadist.launch(_parent_and_env, 1)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    for restart_elsewhere in (False, True):
        dead = _server_pid()
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        if restart_elsewhere:  # as multiprocessing does on its next start: it reaps and restarts
            deadline = time.monotonic() + 60
            while not _gone(dead) and time.monotonic() < deadline:
                time.sleep(0.01)
            server.ensure_running()
        else:  # reaped by the program (a SIGCHLD handler, say)
            os.waitpid(dead, 0)
        elsewhere = _server_pid()
        ranks = metadist.launch(_parent_and_env, 2, threads=1)
        now = _server_pid()
        assert now not in (dead, None) and [ppid for ppid, _ in ranks] == [now] * 2
        if restart_elsewhere:
            assert now != elsewhere, "a server of unknown environment served a launch"


def test_a_multiprocessing_whose_server_state_differs_spawns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's state metadist reads is multiprocessing's own, not a public interface:
    where it is not there, ranks are spawned rather than the launch failing."""
    monkeypatch.setattr(forkserver, "_forkserver", object())
    monkeypatch.setattr(rank_start, "_server", {"configured": False, "pid": None, "env": None})
    ranks = metadist.launch(_parent_and_env, 2, threads=1)
    assert [ppid for ppid, _ in ranks] == [os.getpid()] * 2


def _resident_setting() -> tuple[int, str]:
    return os.getppid(), resident.setting()


def _print_a_line() -> None:
    print(f"a line from rank {metadist.world().rank}", flush=True)
    print(f"an error line from rank {metadist.world().rank}", file=sys.stderr, flush=True)


def test_ranks_write_to_the_callers_descriptors_at_launch(
        capfd: pytest.CaptureFixture[str]) -> None:
    """The server started under another test's capture; each launch's ranks write to the
    output and error the caller has now."""
    metadist.launch(_print_a_line, 2, threads=1)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"a line from rank {rank}" in out, out
        assert f"an error line from rank {rank}" in err, err


_CALLER = """
import os
import sys
import time

import metadist

def pid():
    return os.getpid()

if __name__ == "__main__":
    if sys.argv[1] == "own-server":  # the program started a forkserver of its own first
        import multiprocessing as mp
        p = mp.get_context("forkserver").Process(target=os.getpid)
        p.start(); p.join()
    pool = metadist.RankPool(2, threads=1)
    print(*pool.run(pid), flush=True)
    time.sleep(600)
"""


def _start_caller(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(_CALLER))
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(
                                ROOT / "src")})
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ranks are up: an event, not a wait on the clock
    assert line, f"the caller exited with {proc.wait()} before its ranks answered"
    return proc, [int(x) for x in line.split()]


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.parametrize("mode", ["metadist-server", "own-server"])
def test_ranks_end_when_their_caller_is_killed(tmp_path: Path, mode: str) -> None:
    """A forked rank's parent is the server, which stays while ranks hold it; they watch the
    caller. A program that started a forkserver of its own gets spawned ranks (that server's
    preload and environment are unknown), which the kernel ends with their parent."""
    proc, ranks = _start_caller(tmp_path, mode)
    try:
        parents = {_parent_of(r) for r in ranks}
        if mode == "own-server":
            assert parents == {proc.pid}
        else:
            assert len(parents) == 1 and parents != {proc.pid}
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60  # the watch ticks every second; a loaded machine is slow
        while not all(_gone(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(r) for r in ranks), "a rank outlived its killed caller"
    finally:
        proc.kill()
        proc.wait()
        for r in ranks:
            if not _gone(r):
                os.kill(r, signal.SIGKILL)
