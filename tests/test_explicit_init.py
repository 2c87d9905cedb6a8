"""Reading who and where a strategy runs joins nothing: ``strategy.world``, ``.device`` and
``.is_global_zero`` answer from the launch environment until ``strategy.init()`` (or setup,
backward, save, ... which call it) joins the job, and that answer is what init then makes."""

from __future__ import annotations

import os
import subprocess
import sys

from metadist.runtime.spawn import free_port

_READ = """
import metadist
s = metadist.strategy("ddp")
w = s.world
print(w.rank, w.world_size, w.local_rank, s.device, s.is_global_zero, metadist.is_initialized())
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT", "METADIST_LAUNCHER")}
    # A rendezvous with a peer that never comes waits for METADIST_TIMEOUT, then fails: the
    # subprocess timeout below is only a backstop far beyond it.
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env,
                                                             "METADIST_TIMEOUT": "60"},
                          capture_output=True, text=True, timeout=240, check=False)


def test_reading_the_world_of_a_two_rank_job_joins_nothing() -> None:
    # Rank 1 of a two-rank job whose rank 0 never starts: joining would wait for it.
    done = _run(_READ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "1", "cpu", "False", "False"]


def test_init_makes_the_world_that_was_answered_or_refuses() -> None:
    same = _run(_READ + "assert metadist.init() == w and s.world is not None\nprint('same')")
    assert same.returncode == 0, same.stderr
    assert same.stdout.split() == ["0", "1", "0", "cpu", "True", "False", "same"]
    other = _run(_READ + "metadist.init(device='meta')")
    assert other.returncode != 0
    assert "was read before metadist.init and answered" in other.stderr
    assert "call metadist.init(...) with these arguments before reading" in other.stderr
