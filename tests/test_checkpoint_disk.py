"""A checkpoint save onto a full file system says so, for both formats, with rank 0 (which
wrote) as the origin and the other ranks' copies of the error as consequences.

Observed before: the full format reported torch's archive writer's "[enforce fail at
inline_container.cc:672] . unexpected pos ..." and every rank's error looked like an origin,
so `metadist run` named a rank terminated as a consequence. The file system is a real one:
a 256 KiB tmpfs mounted for the test (skipped where mounting is not permitted).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import metadist
from metadist.testing import run_on_ranks


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                             capture_output=True, text=True, timeout=30, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30,
                       check=False)


def _save_too_much(path: str, fmt: str) -> tuple[str, bool]:
    s = metadist.strategy("ddp")
    net = nn.Linear(256, 512)  # 513 KiB of parameters: more than the file system holds
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(metadist.CheckpointError) as info:
        s.save(path, {"model": model}, format=fmt)
    return str(info.value), info.value.secondary


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_full_disk_is_named_with_rank_zero_as_the_origin(full_disk: Path, fmt: str) -> None:
    out = run_on_ranks(_save_too_much, 2, args=(str(full_disk / "ckpt"), fmt))
    for rank, (message, secondary) in enumerate(out):
        assert "failed on rank 0" in message and "No space left on device" in message, message
        assert "free space there or save to another directory" in message
        assert "unexpected pos" not in message
        assert secondary == (rank != 0)
