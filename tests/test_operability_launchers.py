"""Operability through real launchers: `metadist run` fails the whole job, shows the origin
rank's traceback once and exits non-zero when a rank raises, is killed or hangs (3 s
timeout); `metadist env` reports backends, device, versions and the variables that matter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metadist.testing import is_loopback_address

pytestmark = pytest.mark.launcher
MISBEHAVE = str(Path(__file__).parent / "scripts" / "misbehave.py")
LISTENERS = str(Path(__file__).parent / "scripts" / "listeners.py")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "OMPI_",
                                "PMI", "SLURM_", "TORCHELASTIC_", "METADIST_", "NCCL_", "GLOO_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _metadist(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "metadist", *args], capture_output=True,
                          text=True, timeout=180, env=_clean_env(**env), check=False)
    return proc, time.monotonic() - start


def test_run_shows_the_raising_ranks_traceback_once() -> None:
    proc, _ = _metadist("run", "--nproc", "2", MISBEHAVE, "raise")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr
    assert "ValueError: deliberate failure on rank 1" in proc.stderr
    assert "origin rank: 1 (exit code 1): ValueError: deliberate failure on rank 1" \
        in proc.stderr, proc.stderr  # the whole summary where it differs (pytest cuts it)
    assert "rank=0 done" not in proc.stdout


def test_run_names_a_killed_rank_as_the_origin() -> None:
    proc, _ = _metadist("run", "--nproc", "2", MISBEHAVE, "kill")
    assert proc.returncode == 1, proc.stderr
    assert "origin rank: 1 (killed by signal SIGKILL)" in proc.stderr
    assert "Traceback" not in proc.stderr  # rank 0's lost peer is one line, never a traceback


def test_run_names_a_rank_that_ended_cleanly_without_the_collective() -> None:
    # Rank 1 skips all_reduce #2 and its program ends without an error: rank 0's broken
    # collective is then the origin, and it says what rank 1 last did.
    proc, _ = _metadist("run", "--nproc", "2", MISBEHAVE, "skip")
    assert proc.returncode == 1, proc.stderr
    assert ("origin rank: 0 (exit code 1): CollectiveFailedError: all_reduce #2 on the world "
            "group failed on rank 0: a peer's connection closed; rank 1 had already left the "
            "job after its #1 all_reduce on this group") in proc.stderr, proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") >= 1


def test_run_stops_a_hung_job_after_the_timeout() -> None:
    # (Never the 600 s sleep: the 180 s subprocess limit would raise first.)
    proc, _ = _metadist("run", "--nproc", "2", MISBEHAVE, "hang", METADIST_TIMEOUT="3")
    assert proc.returncode == 1, proc.stderr
    # the stuck rank is the origin; the rank that waited for it reported the timeout
    assert re.search(r"origin rank: 1 \(hung: rank 0 waited for it; .*\)", proc.stderr), \
        proc.stderr
    assert re.search(r"rank 0 reported the timeout \(.*\): CollectiveTimeoutError: all_reduce "
                     r"#2 on the world group did not complete within 3 s on rank 0: rank 1 did "
                     "not arrive", proc.stderr), proc.stderr
    assert "misbehave.py" in proc.stderr  # where rank 0 waited, and where rank 1 hung


def test_env_reports_backends_device_versions_and_variables() -> None:
    proc, _ = _metadist("env", METADIST_TIMEOUT="7", NCCL_DEBUG="INFO", GLOO_SOCKET_IFNAME="lo",
                        SLURM_JOB_ID="42", OMPI_MCA_foo="1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for section in ("versions", "launch", "backends", "device", "metadist settings",
                    "environment"):
        assert f"== {section} ==" in out
    for pattern in (r"torch\s+\d", r"gloo\s+available", r"nccl\s+(not )?available",
                    r"mpi\s+(not )?available", r"mpirun\s+\S", r"device\s+(cpu|cuda)",
                    r"launcher\s+single", r"timeout\s+7 s", r"debug\s+off",
                    r"MASTER_ADDR\s+\(unset\)", r"WORLD_SIZE\s+\(unset\)",
                    r"NCCL_DEBUG\s+INFO", r"GLOO_SOCKET_IFNAME\s+lo", r"OMP_NUM_THREADS\s+1",
                    r"SLURM_\*\s+SLURM_JOB_ID=42", r"OMPI_\*\s+OMPI_MCA_foo=1",
                    r"TORCHELASTIC_\*\s+none set", r"METADIST_\*\s+METADIST_TIMEOUT=7"):
        assert re.search(pattern, out), f"{pattern!r} not in:\n{out}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_run_on_one_node_listens_on_loopback_only() -> None:
    # torch's agent would serve its rendezvous and the workers' store on every interface:
    # metadist run meets through a file and rank 0's worker serves the store on loopback.
    proc, _ = _metadist("run", "--nproc", "2", LISTENERS)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^rank=(\d) who=(\w+) (\S+)$", proc.stdout, re.MULTILINE)
    assert ("0", "worker") in {(r, w) for r, w, _ in rows}, proc.stdout  # the store, gloo
    for rank, who, address in rows:
        assert is_loopback_address(address), f"rank {rank}'s {who} listens on {address}"
