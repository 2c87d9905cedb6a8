"""`metadist bench --device`: on the CPU (and ``auto`` without a GPU) the benchmarks run as
they always did; ``cuda`` without a GPU is refused before anything runs; a run whose ranks
had GPUs says so, by name, in results.json and the report. The GPU path itself runs only
where there is one (issue 29, item 4)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from metadist import cli

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the benchmarks live in the checkout, not in the package

from benchmarks import device, suite  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine has no GPU")


def _args(requested: str, world: int | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    device.add_args(ap)
    return ap.parse_args(["--device", requested, *(["--world", str(world)] if world else [])])


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(device, "_chosen", {})


@no_gpu
def test_auto_and_cpu_without_a_gpu_are_the_cpu_with_gloo_and_two_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_chosen", {})
    for requested in ("auto", "cpu"):
        args = _args(requested)
        assert device.resolve(args) == "cpu" and (args.device, args.world) == ("cpu", 2)
        assert device.environment() == {"device": "cpu", "backend": "gloo",
                                        "cuda_available": False, "cuda_device": None}
        assert device.where(2) == "gloo, 1 thread per rank"  # the CPU headings, unchanged


@no_gpu
def test_cuda_without_a_gpu_says_so_and_what_to_run_instead() -> None:
    with pytest.raises(SystemExit, match=r"--device cuda: no CUDA GPU is visible .*run with "
                                         r"--device cpu or auto"):
        device.resolve(_args("cuda"))


def test_with_gpus_auto_takes_one_rank_per_gpu_and_refuses_more_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 1)
    args = _args("auto")
    assert device.resolve(args) == "cuda" and args.world == 1
    env = device.environment()
    assert (env["device"], env["backend"], env["cuda_device"], env["gpus"]) == (
        "cuda", "nccl", "NVIDIA H200", 1)
    assert device.where(1) == "NCCL, one NVIDIA H200 per rank"
    with pytest.raises(SystemExit, match=r"--world 2 on --device cuda needs one GPU per rank "
                                         r"and 1 is visible: pass --world 1 or less"):
        device.resolve(_args("cuda", world=2))


def test_cpu_on_a_gpu_machine_hides_the_gpus_from_the_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device.resolve(_args("cpu")) == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # metadist then picks the CPU and gloo
    env = device.environment()
    assert (env["device"], env["cuda_available"], env["cuda_device"]) == (
        "cpu", True, "NVIDIA H200")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with device.cpu_ranks():  # Betty's part of benchmarks.meta, whatever --device says
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_memory_helpers_count_storages_on_the_cpu() -> None:
    from metadist.testing import bytes_kept_by

    fn = lambda: torch.ones(1000) * 2  # noqa: E731
    assert device.kept_bytes(fn)[1] == bytes_kept_by(fn)[1] == 4000
    assert device.step_peak(fn) is None  # no extra step on the CPU


@no_gpu
def test_bench_refuses_cuda_without_a_gpu_before_running_anything(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--device", "cuda", "--only", "ddp",
                     "--out", str(tmp_path / "out")]) == 2
    assert "metadist bench: --device cuda: no CUDA GPU is visible" in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


_FAKE = """import json, sys
argv = sys.argv
path = argv[argv.index('--json') + 1]
gpu = '--device' in argv and argv[argv.index('--device') + 1] == 'cuda'
env = ({'device': 'cuda', 'backend': 'nccl', 'cuda_available': True,
        'cuda_device': 'NVIDIA H200', 'gpus': 1, 'cuda': '13.0'} if gpu else
       {'device': 'cpu', 'backend': 'gloo', 'cuda_available': False, 'cuda_device': None})
table = {'key': 't', 'title': 'args', 'columns': ['argv'], 'rows': [[' '.join(argv[1:])]]}
json.dump({'tables': [table], 'notes': [], 'skipped': [], 'data': {}, 'environment': env},
          open(path, 'w'))
"""


def _fake_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              requested: str | None) -> dict[str, Any]:
    fakes = tmp_path / "fakes"
    fakes.mkdir(exist_ok=True)
    (fakes / "fake_bench.py").write_text(_FAKE)
    monkeypatch.setenv("PYTHONPATH", str(fakes))
    specs = [suite.Spec(name, "fake_bench") for name in ("comm", "ddp", "zero")]
    return suite.run_suite(specs, tmp_path / str(requested), quick=True, timeout=60,
                           echo=None, device=requested)


def test_the_suite_hands_device_to_the_benchmarks_that_take_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _fake_run(tmp_path, monkeypatch, "cpu")["benchmarks"]
    assert "--device" not in runs["comm"]["command"]  # comm stays on the CPU
    assert runs["ddp"]["command"].endswith("--quick --device cpu")
    default = _fake_run(tmp_path, monkeypatch, None)  # auto: each benchmark decides
    assert all("--device" not in e["command"] for e in default["benchmarks"].values())
    assert "device" not in default["settings"]
    text = (tmp_path / "None" / "report.md").read_text()
    assert "| benchmark | status | wall s | command |" in text  # the CPU report as it was


def test_a_gpu_run_names_the_gpu_in_results_and_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = _fake_run(tmp_path, monkeypatch, "cuda")
    m = results["machine"]
    assert (m["device"], m["backend"], m["cuda_device"], m["gpus"]) == (
        "cuda", "nccl", "NVIDIA H200", 1)
    saved = json.loads((tmp_path / "cuda" / "results.json").read_text())
    assert saved["machine"]["cuda_device"] == "NVIDIA H200"
    assert saved["settings"]["device"] == "cuda"
    text = (tmp_path / "cuda" / "report.md").read_text()
    assert ("cuda (nccl): 1 x NVIDIA H200, CUDA 13.0, one GPU per rank, for ddp, zero; the "
            "other benchmarks on the CPU (gloo)") in text
    assert "one rank per GPU for ddp, zero, else 2" in text
    assert "| benchmark | status | device | wall s | command |" in text
    assert "| comm | ok | cpu |" in text and "| ddp | ok | cuda |" in text


def _run(bench: str, *argv: str, out: Path) -> dict[str, Any]:
    """``python -m benchmarks.NAME --quick ... --json out``'s results."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{bench}", "--quick", *argv,
                           "--json", str(out)], check=False, cwd=ROOT, env=env,
                          capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def _shape(value: Any) -> Any:
    """Everything but the measured numbers: titles, columns, row labels, keys."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return value if isinstance(value, str) and not value[:1].isdigit() else 0


@no_gpu
@pytest.mark.launcher
def test_ddp_benchmark_on_cpu_and_auto_is_the_cpu_benchmark(tmp_path: Path) -> None:
    cpu = _run("ddp", "--workloads", "mlp", "--device", "cpu", out=tmp_path / "cpu.json")
    auto = _run("ddp", "--workloads", "mlp", out=tmp_path / "auto.json")
    for got in (cpu, auto):
        assert got["environment"]["device"] == "cpu" and got["settings"]["device"] == "cpu"
        assert got["settings"]["world"] == 2
        assert got["tables"][0]["title"].startswith(
            "ddp step time, world size 2, gloo, 1 thread per rank, Adam")
        assert [r[0] for r in got["tables"][1]["rows"]] == ["mlp"] * 3  # CPU phase times
    assert _shape(cpu["tables"]) == _shape(auto["tables"])
    assert _shape(cpu["data"]) == _shape(auto["data"])
