"""Implicit differentiation in a distributed TorchOpt program: iMAML with each task's inner
problem under ``custom_root``, tasks sent to the workers by ``parallelize`` (the rpc engine,
rank 0 driving, torch's distributed autograd carrying the meta-gradient back), equal to one
process: the same program on one worker, and the tasks run in turn in this process with the
meta-gradient by ``torch.autograd`` (issue 27: exact where it applies)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from metadist import mapreduce

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "torchopt_programs" / "imaml_distributed.py"
STEPS = 3
TOL = {"rtol": 1e-12, "atol": 1e-12}  # float64; the parts' sums only reorder


def _program() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchopt_imaml_program", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(nproc: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE",
                                                                      "MASTER_", "LOCAL_"))}
    env.pop(mapreduce.ENGINE_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "metadist", "run", "--nproc", str(nproc),
                           str(PROGRAM), "--steps", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, check=False,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("task on worker") == STEPS * 4, proc.stdout[-2000:]
    return torch.load(out)  # type: ignore[no-any-return]


def _reference() -> list[torch.Tensor]:
    program = _program()
    net = program.build_model()
    meta_opt = torch.optim.SGD(net.parameters(), lr=program.META_LR)
    for step in range(STEPS):
        x_spt, y_spt, x_qry, y_qry = program.sample_tasks(step)
        meta_opt.zero_grad()
        losses = [program.run_task(net, x_spt[i], y_spt[i], x_qry[i], y_qry[i])
                  for i in range(program.TASKS)]
        torch.stack(losses).mean().backward()
        meta_opt.step()
    return [p.detach() for p in net.parameters()]


def test_custom_root_across_workers_equals_one_process(tmp_path: Path) -> None:
    two = _train(2, tmp_path / "two.pt")
    one = _train(1, tmp_path / "one.pt")
    assert (two["world_size"], one["world_size"]) == (2, 1)
    reference = _reference()
    start = [p.detach() for p in _program().build_model().parameters()]
    moved = max((p - q).abs().max().item() for p, q in zip(reference, start, strict=True))
    assert moved > 1e-3  # the meta-steps moved the parameters: the comparison means something
    gaps = {name: max((p - r).abs().max().item() for p, r in zip(run, reference, strict=True))
            for name, run in (("two workers", two["params"]), ("one worker", one["params"]))}
    for p, q, r in zip(two["params"], one["params"], reference, strict=True):
        torch.testing.assert_close(p, r, **TOL, msg=lambda m: f"{m}\n{gaps}")
        torch.testing.assert_close(q, r, **TOL, msg=lambda m: f"{m}\n{gaps}")
