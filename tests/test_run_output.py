"""Every line a rank prints arrives whole, and with --rank-prefix says which rank wrote it.

Observed before (issue 25): 4 ranks printing 400 short lines each under `metadist run
--nproc 4`: 1430 of the 1600 lines arrived whole, the rest joined with another rank's line
or split (unbuffered output writes a print's text and its newline separately).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHATTY = str(Path(__file__).parent / "scripts" / "chatty.py")
LINES = 400
pytestmark = pytest.mark.launcher


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_",
                                "TORCHELASTIC_", "METADIST_"))}
    env.update(OMP_NUM_THREADS="1")
    return env


def _whole(out: str, prefixed: bool) -> dict[int, int]:
    """Whole lines per rank (a prefix, when asked for, must name the rank the line is from)."""
    counts: dict[int, int] = {}
    pattern = (r"\[rank (\d)\] rank (\d) line \d+ x{40}" if prefixed
               else r"()rank (\d) line \d+ x{40}")
    for line in out.splitlines():
        found = re.fullmatch(pattern, line)
        if found and (not prefixed or found.group(1) == found.group(2)):
            rank = int(found.group(2))
            counts[rank] = counts.get(rank, 0) + 1
    return counts


@pytest.mark.parametrize("prefixed", [False, True])
def test_metadist_run_delivers_every_line_whole(prefixed: bool) -> None:
    proc = subprocess.run([sys.executable, "-m", "metadist", "run", "--nproc", "4",
                           *(["--rank-prefix"] if prefixed else []), CHATTY, str(LINES)],
                          capture_output=True, text=True, env=_env(), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert _whole(proc.stdout, prefixed) == {r: LINES for r in range(4)}


_LAUNCH = f"""
import runpy, sys
import metadist

def body():
    sys.argv = ["chatty", "{LINES}"]
    runpy.run_path({CHATTY!r}, run_name="chatty")

metadist.launch(body, 4)
"""


def test_launch_delivers_every_line_whole() -> None:
    proc = subprocess.run([sys.executable, "-c", _LAUNCH], capture_output=True, text=True,
                          env=_env(), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert _whole(proc.stdout, False) == {r: LINES for r in range(4)}
