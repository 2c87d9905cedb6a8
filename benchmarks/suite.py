"""Run the benchmarks, each in its own process, and write a report with plots.

    python -m benchmarks.suite [--out out/bench] [--only comm,ddp,...] [--quick] [--world N]
                               [--device auto|cpu|cuda]

(``metadist bench`` runs this from the source checkout.) Every benchmark runs as
``python -m benchmarks.NAME --json OUT/raw/NAME.json`` in its own process group, so one that
fails or hangs is recorded in the report and the others still run. Writes OUT/results.json
(machine, settings and every benchmark's structured results), OUT/report.md and its PNGs,
and OUT/logs/NAME.log (each benchmark's stdout and stderr). Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from benchmarks import PEERS, ROOT

BENCHMARKS = ("comm", "ddp", "zero", "precision", "checkpoint", "meta", "mapreduce",
              "betty_compat", "torchopt_compat", "real_models", "deferred_init",
              "compiled", "sharded_meta", "affordable_meta", "maml_overhead",
              "task_batchnorm", "agreement", "dtensor_spike", "gpu_step", "launch_start")


class SuiteError(Exception):
    """A bad request (unknown benchmark, bad option): nothing was run."""


@dataclass(frozen=True)
class Spec:
    """How to run one benchmark: its module, fixed options, and what it depends on."""

    name: str
    module: str
    args: tuple[str, ...] = ()
    full: tuple[str, ...] = ()  # not under --quick: the settings of the README's tables
    world: bool = True  # takes --world (meta and mapreduce fix their world sizes)
    peers: tuple[str, ...] = ()  # anchor libraries it takes from .bench/


#: The benchmarks that take --device: on a GPU under auto/cuda (the rest stay on the CPU).
ON_DEVICE = ("ddp", "zero", "precision", "meta", "real_models", "maml_overhead", "gpu_step")


def spec(name: str) -> Spec:
    """The benchmark called ``name``."""
    module = f"benchmarks.{name}"
    match name:
        case "comm":  # the debug-mode overhead too, not only the collectives
            return Spec(name, module, ("--latency",))
        case "ddp" | "checkpoint" | "real_models" | "compiled":
            return Spec(name, module)
        case "precision":  # bf16 is ~20x slower than fp32 on CPUs without bf16 units
            return Spec(name, module, full=("--steps", "3", "--warmup", "1"))
        case "zero":
            return Spec(name, module, peers=("fairscale",))
        case "meta":
            return Spec(name, module, full=("--steps", "30"), world=False, peers=("betty",))
        case "betty_compat":  # Betty in one process, the drop-in also on 2 ranks
            return Spec(name, module, full=("--steps", "100"), world=False, peers=("betty",))
        case "mapreduce":
            return Spec(name, module, world=False, peers=("torchopt",))
        case "torchopt_compat":  # whole runs alternate: TorchOpt and the drop-in both start RPC
            return Spec(name, module, world=False, peers=("torchopt",))
        case "deferred_init":  # its own world sizes (2 and 4): the peak against model/world
            return Spec(name, module, world=False)
        case "sharded_meta":  # its own world sizes (1, 2 and 4, hsdp 2 x 2)
            return Spec(name, module, world=False)
        case "affordable_meta":  # its own world sizes (1, 2 and 4), two allocator settings
            return Spec(name, module, world=False)
        case "maml_overhead":  # world 1: what the strategies' code adds, no collective
            return Spec(name, module, world=False)
        case "task_batchnorm":  # 2 ranks: combining the running statistics at the step
            return Spec(name, module, world=False)
        case "agreement" | "dtensor_spike":  # the step's agreement; shards as DTensors
            return Spec(name, module)
        case "launch_start":  # its own world sizes; new programs of its own for first launches
            return Spec(name, module, world=False)
        case "gpu_step":  # world 1, a process per case; the size on cuda, tiny on CPUs
            return Spec(name, module, world=False)
    raise SuiteError(f"benchmark {name!r} is not known; choose from: {', '.join(BENCHMARKS)}")


def select(only: str | None) -> list[Spec]:
    """The benchmarks named in a comma-separated list (all of them for none), in order."""
    names = [n.strip() for n in (only or "").split(",") if n.strip()] or list(BENCHMARKS)
    return [spec(name) for name in dict.fromkeys(names)]


def check_device(device: str | None) -> None:
    """Refuse ``--device cuda`` without a GPU before anything runs (torch is imported only
    here, and only then: the suite itself stays light)."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise SuiteError(f"--device cuda: no CUDA GPU is visible to torch {torch.__version__} "
                         f"(CUDA build: {torch.version.cuda or 'none'}); run with --device cpu "
                         "or auto, or on a machine with a GPU")


def machine() -> dict[str, Any]:
    """What the figures depend on, read without importing torch (the suite stays light);
    the benchmarks add the device they ran on."""
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": version("torch"), "metadist": version("metadist"),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "loadavg": load(), **checkout()}


def checkout() -> dict[str, Any]:
    """The commit of the checkout the benchmarks ran from, and whether its tracked files had
    changes on top (both absent outside a git checkout)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return {}
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def load() -> list[float] | None:
    """The 1/5/15-minute load averages now: other work sharing the cores moves the figures
    (the suite records them at its start and after each benchmark)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def peers() -> dict[str, Any]:
    """Which anchor libraries `make bench` installed into .bench/."""
    libs = ("fairscale", "betty", "torchopt")
    return {"dir": str(PEERS), "present": PEERS.is_dir(),
            "installed": {lib: (PEERS / lib).is_dir() for lib in libs}}


def _child_env() -> dict[str, str]:
    """Our checkout first on the path; no launcher variables (the benchmarks start their own
    ranks); unbuffered, so the log shows progress as it happens."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_logged(cmd: list[str], log: Path, timeout: float, echo: TextIO | None) -> int | None:
    """Run ``cmd`` from the checkout, its output into ``log`` (and ``echo``); the exit code,
    or None after stopping its whole process group at ``timeout`` (ranks included)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                if echo is not None:
                    echo.write(line)
                    echo.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            _stop(proc)
        except BaseException:  # Ctrl-C: its own session does not get the terminal's SIGINT
            _stop(proc)
            raise
        reader.join(5.0)
    return code


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop a benchmark and the ranks it started (its process group): politely, then not."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(10.0)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_one(s: Spec, out: Path, quick: bool, world: int | None, timeout: float,
            echo: TextIO | None, device: str | None = None) -> dict[str, Any]:
    """Run one benchmark; its entry in results.json whether it worked or not."""
    raw, log = out / "raw" / f"{s.name}.json", out / "logs" / f"{s.name}.log"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.unlink(missing_ok=True)  # never report a previous run's figures as this one's
    cmd = [sys.executable, "-m", s.module, "--json", str(raw), *s.args]
    if s.name == "ddp":
        cmd += ["--plot", str(out / "ddp_step_time.png")]
    cmd += ["--quick"] if quick else list(s.full)
    if world is not None and s.world:
        cmd += ["--world", str(world)]
    if device is not None and s.name in ON_DEVICE:
        cmd += ["--device", device]
    if echo is not None:
        echo.write(f"\n=== {s.name}: {shlex.join(cmd)}\n")
        echo.flush()
    start = time.monotonic()
    code = _run_logged(cmd, log, timeout, echo)
    entry: dict[str, Any] = {"command": shlex.join(cmd), "returncode": code,
                             "seconds": round(time.monotonic() - start, 1),
                             "log": str(log.relative_to(out)), "loadavg": load()}
    if raw.is_file():  # after a failure: what it measured before (its tables say)
        entry["result"] = json.loads(raw.read_text())
    if code == 0 and raw.is_file():
        entry["status"] = "ok"
    else:
        why = (f"timed out after {timeout:.0f} s (its processes were stopped)" if code is None
               else f"exited with status {code}" if code else "wrote no JSON results")
        entry.update(status="failed", error=f"{why}; last lines of {entry['log']}:\n"
                                            f"{_tail(log)}")
    if echo is not None:
        echo.write(f"=== {s.name}: {entry['status']} in {entry['seconds']} s\n")
    return entry


def run_suite(specs: list[Spec], out: Path, *, quick: bool = False, world: int | None = None,
              timeout: float | None = None, command: str = "",
              echo: TextIO | None = sys.stdout, device: str | None = None) -> dict[str, Any]:
    """Run ``specs`` one after another (never side by side: they would time each other),
    then write results.json and the report; the results."""
    out.mkdir(parents=True, exist_ok=True)
    limit = timeout or (600.0 if quick else 7200.0)
    start = time.monotonic()
    results: dict[str, Any] = {
        "command": command or shlex.join(["python", "-m", "benchmarks.suite", *sys.argv[1:]]),
        "machine": machine(), "peers": peers(),
        "settings": {"quick": quick, "world": world, "only": [s.name for s in specs],
                     "timeout_s": limit, **({"device": device} if device else {})},
        "benchmarks": {}}
    for s in specs:
        results["benchmarks"][s.name] = run_one(s, out, quick, world, limit, echo, device)
    results["seconds"] = round(time.monotonic() - start, 1)
    ran = [e["result"].get("environment", {}) for e in results["benchmarks"].values()
           if e["status"] == "ok"]
    for env in sorted(ran, key=lambda e: e.get("device") != "cuda")[:1]:  # a GPU's first
        results["machine"].update({k: env.get(k) for k in (
            "device", "backend", "cuda_available", "cuda_device")})
        if env.get("device") == "cuda":
            results["machine"].update(gpus=env.get("gpus"), cuda=env.get("cuda"))
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    from benchmarks.report import write_report

    report = write_report(results, out)
    if echo is not None:
        echo.write(f"\nreport: {report}\nresults: {out / 'results.json'}\n")
    return results


def build_parser() -> argparse.ArgumentParser:
    # `metadist bench` hands its arguments straight to this parser (python -m benchmarks.suite
    # takes the same ones).
    ap = argparse.ArgumentParser(prog="metadist bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench", help="output directory (default out/bench)")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated benchmarks (default all: {','.join(BENCHMARKS)})")
    ap.add_argument("--quick", action="store_true",
                    help="tiny models, 2 steps, 1 warm-up: checks the pipeline in seconds; "
                         "the figures mean nothing")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks for the benchmarks that take it (default theirs: 2; on "
                         "cuda one per GPU)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                    help=f"where {', '.join(ON_DEVICE)} compute: auto (the default: cuda, one "
                         "GPU per rank over NCCL, when a GPU is visible), cpu or cuda; the "
                         "other benchmarks run on the CPU")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per benchmark before it is stopped (default 7200, quick 600)")
    ap.add_argument("--command", default="", help=argparse.SUPPRESS)  # as the user typed it
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        specs = select(args.only)
        if args.world is not None and args.world < 1:
            raise SuiteError(f"--world must be at least 1, got {args.world}")
        check_device(args.device)
    except SuiteError as err:
        print(f"metadist bench: {err}", file=sys.stderr)
        return 2
    results = run_suite(specs, Path(args.out).resolve(), quick=args.quick, world=args.world,
                        timeout=args.timeout, command=args.command, device=args.device)
    failed = [n for n, e in results["benchmarks"].items() if e["status"] != "ok"]
    if failed:
        print(f"metadist bench: {', '.join(failed)} failed (see the report and "
              f"{args.out}/logs/)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
