"""A script written for TorchOpt's torchopt.distributed, with only its import line changed,
under `metadist run --nproc 2` on both engines (each equals single-process MAML:
tests/test_mapreduce.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).parent / "scripts" / "torchopt_port.py")
pytestmark = pytest.mark.launcher


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_",
                                "TORCHELASTIC_", "METADIST_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _result(command: list[str], **env: str) -> dict[str, str]:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=_env(**env),
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = re.findall(r"^result .*$", proc.stdout, flags=re.MULTILINE)
    assert len(lines) == 1, proc.stdout  # rank 0 only
    return dict(item.split("=", 1) for item in lines[0].split()[1:])


def test_torchopt_script_runs_unchanged_on_both_engines() -> None:
    run = [sys.executable, "-m", "metadist", "run", "--nproc", "2", SCRIPT]
    every_rank = _result(run)
    rank0_drives = _result([*run, "--driver", "rank0"], METADIST_MAPREDUCE_ENGINE="rpc")
    assert (every_rank["engine"], every_rank["world"]) == ("spmd", "2")
    assert (rank0_drives["engine"], rank0_drives["world"]) == ("rpc", "2")
    assert every_rank["worker"] == rank0_drives["worker"] == "worker0"  # worker_init_fn ran
    assert every_rank["points"] == rank0_drives["points"] == "200"  # 4 steps x 5 tasks x 10
    for key in ("loss", "test", "checksum"):
        assert float(every_rank[key]) == pytest.approx(float(rank0_drives[key]), rel=1e-5,
                                                       abs=1e-6)
