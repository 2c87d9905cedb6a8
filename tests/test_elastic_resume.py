"""Elastic resume for real: `metadist run --max-restarts 1`, a rank SIGKILLed mid-training (or
mid-checkpoint), the job restarted from the last complete checkpoint, and final parameters
bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = str(Path(__file__).parent / "scripts" / "elastic_train.py")
pytestmark = pytest.mark.launcher


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "OMPI_",
                                "PMI", "SLURM_", "TORCHELASTIC_", "METADIST_"))}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "metadist", "run", *args], capture_output=True,
                          text=True, timeout=240, env=env, check=False)


@pytest.mark.parametrize(("kill", "strategy"), [("between", "ddp"), ("mid-save", "zero3")])
def test_a_killed_job_resumes_from_its_last_complete_checkpoint(tmp_path: Path, kill: str,
                                                                strategy: str) -> None:
    proc = _run("--nproc", "2", "--max-restarts", "1", SCRIPT, "--out", str(tmp_path),
                "--kill", kill, "--strategy", strategy)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        # step 9's save was killed half-way: its shards were left behind, uncommitted
        stray = 1 if kill == "mid-save" else 0
        assert f"rank={rank} attempt=1 resumed step=6 stray={stray}" in proc.stdout, proc.stdout
        assert f"rank={rank} attempt=1 finished" in proc.stdout
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["resumed"].keys() == final["reference"].keys()
    for name, value in final["reference"].items():
        assert torch.equal(final["resumed"][name], value), name
    # the next successful save removed the interrupted one's leftovers
    assert len([p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("v-")]) == 1
