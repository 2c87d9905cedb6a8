"""The README's demo and the examples run end to end (small settings)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE",
                                                                      "MASTER_", "LOCAL_"))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False, cwd=ROOT)


def test_digits_demo_trains_on_two_processes(tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    proc = _run(["-m", "metadist", "demo", "digits", "--epochs", "4", "--plot", str(plot)])
    assert proc.returncode == 0, proc.stderr
    assert "on 2 rank(s)" in proc.stdout
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", proc.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 90
    assert plot.stat().st_size > 1000


def test_maml_example_runs_under_metadist_run() -> None:
    proc = _run(["-m", "metadist", "run", "--nproc", "2", "examples/maml_sinusoid.py",
                 "--steps", "3", "--meta-batch", "4"])
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"step\s+2\s+meta-loss \d", proc.stdout)
