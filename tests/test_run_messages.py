"""What `metadist run` says when the launch itself fails or is interrupted: one summary (the
launcher's traceback in a log it names), not torch's tracebacks.

Observed before (issue 25): a taken rendezvous port and a SIGTERM printed raw torch
tracebacks with no summary, a Ctrl-C 121 lines (a traceback per rank and the launcher's),
and nothing said that --max-restarts had run out.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metadist.runtime.spawn import free_port

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.launcher


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_",
                                "TORCHELASTIC_", "METADIST_"))}
    env.update(OMP_NUM_THREADS="1")
    return env


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "metadist", "run", *args], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _under_way(proc: subprocess.Popen[str], marker: Path, nproc: int) -> None:
    deadline = time.monotonic() + 60
    while not all(Path(f"{marker}.{r}").exists() for r in range(nproc)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.1)


def _log_named(err: str) -> str:
    found = re.search(r"the launcher's traceback: (\S+\.log)\)", err)
    assert found, err
    log = Path(found.group(1))
    assert "Traceback (most recent call last)" in log.read_text()
    log.unlink()
    return err


def test_a_taken_port_is_named_with_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _start("--nproc", "2", "--master-port", str(port),
                      str(SCRIPTS / "allreduce.py"))
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: the port is taken (EADDRINUSE)" in err, err
    assert "Choose another with --master-port" in err
    assert "Traceback" not in _log_named(err)


@pytest.mark.parametrize(("how", "code"), [("ctrl-c", 130), ("sigterm", 143)])
def test_an_interrupted_run_says_so_in_one_summary(tmp_path: Path, how: str, code: int) -> None:
    marker = tmp_path / "mark"
    proc = _start("--nproc", "2", str(SCRIPTS / "steady.py"), str(marker))
    _under_way(proc, marker, 2)
    if how == "ctrl-c":  # the terminal's: to the whole foreground group, workers included
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    name = "SIGINT (Ctrl-C)" if how == "ctrl-c" else "SIGTERM"
    assert proc.returncode == code, err
    assert f"was stopped by {name}; every worker was sent" in err, err
    assert "Traceback" not in _log_named(err)
    if how == "ctrl-c":
        for rank in (0, 1):
            assert re.search(rf"\[rank {rank}\] interrupted \(SIGINT\) at .*steady\.py:\d+", err)
    # torch's own warnings about stopping the workers stay; nothing else
    assert len(err.splitlines()) <= 8, err


def test_exhausted_restarts_are_said(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit('always failing')\n")
    proc = _start("--nproc", "1", "--max-restarts", "1", "--master-port", str(free_port()),
                  str(script))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "no restart left: it failed in each of its 2 attempts (--max-restarts 1)" in err, err
