"""Second-order MAML adds no device work and no host syncs over plain torch (issue 29, item 2).

At world 1 no collective runs, so whatever a strategy adds to a MAML meta-step is host-side
work: extra aten ops (each a kernel launch on a GPU) and host syncs (each a stall of a fast
GPU's queue). Counted on the CPU, on benchmarks/maml_overhead.py's meta-step, next to plain
torch's on the same weights and tasks: counts, not times, so deterministic under load. The
losses must stay plain torch's bit for bit (at world 1 the strategies compute with the same
kernels on the same values).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from metadist.testing import count_ops, run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the checkout's
from benchmarks.maml_overhead import meta_steps


def _sgd(params: Any) -> torch.optim.Optimizer:
    # SGD with momentum reads nothing on the host (Adam reads each tensor's step count, once
    # per tensor it steps: a count that differs between whole and flat parameters)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _counts(strategy: str) -> dict[str, Any]:
    """Three meta-steps of plain torch and ``strategy`` taking turns (their losses), then
    one more of each counted."""
    steps = meta_steps(1, 40, 4, optimizer=_sgd)
    mine, plain = steps[strategy], steps["plain torch"]
    losses = [(float(mine()), float(plain())) for _ in range(3)]
    out = {}
    for name, step in (("plain", plain), ("strategy", mine)):
        with count_ops() as c:
            step()
        out[name] = {"ops": c.total, "syncs": c.syncs, "by_op": dict(c.ops)}
    return {"losses": losses, **out}


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero3"])
def test_meta_step_adds_no_ops_and_no_host_syncs_to_plain_torch(strategy: str) -> None:
    got = run_on_ranks(_counts, 1, args=(strategy,))[0]
    for mine, plain in got["losses"]:
        assert mine == plain, got["losses"]
    mine, plain = got["strategy"], got["plain"]
    assert plain["syncs"] == 0, plain
    assert mine["syncs"] == 0, f"{strategy}: {mine['syncs']} host syncs per meta-step"
    extra = {op: n - plain["by_op"].get(op, 0) for op, n in mine["by_op"].items()
             if n > plain["by_op"].get(op, 0)}
    assert mine["ops"] <= plain["ops"], (
        f"{strategy}: {mine['ops']} aten ops per meta-step, plain torch {plain['ops']}; "
        f"more of {extra}")
