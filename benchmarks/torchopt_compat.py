"""The TorchOpt drop-in: one TorchOpt MAML program on TorchOpt 0.7.3 and on
metadist.compat.torchopt, meta-steps per second at world sizes 2 and 4.

    python -m benchmarks.torchopt_compat [--steps 12] [--rounds 2] [--run-steps 5]
        [--worlds 2,4] [--settings conv,light] [--torch-rpc-defaults] [--json PATH] [--quick]

``make_program`` is TorchOpt's distributed few-shot example (maml_omniglot.py) on synthetic
Omniglot-shaped tasks (1x28x28, 5-way, 8 tasks per meta-step), written once against TorchOpt's
API with ``torchopt`` and ``torchopt.distributed as todist`` passed in: a 3-block conv net
with BatchNorm, rank 0 drives under ``@todist.rank_zero_only`` inside
``@todist.auto_init_rpc()``, the other ranks serve; ``todist.parallelize(partitioner=
todist.dim_partitioner(0, exclusive=True, keepdim=False), reducer=todist.mean_reducer)`` runs
a task per part (``torchopt.MetaSGD`` on ``torchopt.module_clone(net_rref.to_here(),
by='reference', detach_buffers=True)``); the outer step is ``todist.autograd.context()`` +
``todist.autograd.backward`` + Adam. Settings: ``conv`` (32 channels, 5-shot, 5 query shots,
2 inner steps) and ``light`` (8 channels, 1-shot, 3 query shots, 1 inner step).

Gloo, CPU, 1 thread per rank, measured two ways:

* same processes: RPC started once (metadist's options, TCP only, as benchmarks/mapreduce.py;
  ``--torch-rpc-defaults``: torch's), TorchOpt, the drop-in and "metadist spmd" (metadist's own
  engine: every rank drives, the module passed as it is, the same per-task code) take turns
  meta-step by meta-step (warm-up discarded, medians); then each trains from the same weights
  in float64 and the parameters are compared with TorchOpt's;
* whole runs: each library as its user runs it, under its own ``auto_init_rpc()`` and RPC
  defaults (TorchOpt: torch's, with shared memory; the drop-in: TCP only). Both start RPC, so
  runs take turns (``--rounds`` each, fresh processes, torchrun's variables), warm-up
  discarded, medians over all steps. TorchOpt comes from ``.bench/`` (``make bench``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

import metadist
from benchmarks import ROOT
from benchmarks.common import Results, alternate, output_args, parse, rotation, use_peers
from metadist import comm

N_WAY, TASKS, INNER_LR, META_LR = 5, 8, 0.1, 1e-3
SETTINGS: dict[str, dict[str, int]] = {
    "conv": {"channels": 32, "k_spt": 5, "k_qry": 5, "inner_steps": 2},
    "light": {"channels": 8, "k_spt": 1, "k_qry": 3, "inner_steps": 1},
}
TORCHOPT, COMPAT, SPMD = "TorchOpt 0.7.3", "metadist.compat.torchopt", "metadist spmd"
CFG: dict[str, int] = {}  # the setting, the same in every rank
T = TypeVar("T")
# build_model's conv biases: each feeds a BatchNorm, so its true gradient is zero and it gets
# only float64 rounding (~1e-17), which Adam scales by lr / eps = 1e5.
CONV_BIASES = frozenset({"0.bias", "4.bias", "8.bias"})


def build_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    c, blocks = CFG["channels"], list[nn.Module]()
    for channels_in in (1, c, c):  # 28 -> 13 -> 5 -> 1
        blocks += [nn.Conv2d(channels_in, c, 3), nn.BatchNorm2d(c, momentum=1.0, affine=True),
                   nn.ReLU(inplace=False), nn.MaxPool2d(2, 2)]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(c, N_WAY)).to(dtype)


def sample_tasks(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``TASKS`` tasks: per class a random prototype image, samples are it plus noise."""
    g = torch.Generator().manual_seed(1000 + step)
    prototypes = torch.rand(TASKS, N_WAY, 1, 1, 28, 28, generator=g, dtype=dtype)

    def draw(shots: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(TASKS, N_WAY, shots, 1, 28, 28, generator=g, dtype=dtype)
        x = (prototypes + 0.5 * noise).reshape(TASKS, N_WAY * shots, 1, 28, 28)
        y = torch.arange(N_WAY).repeat_interleave(shots).expand(TASKS, -1).contiguous()
        return x, y

    return (*draw(CFG["k_spt"]), *draw(CFG["k_qry"]))


def module_level(name: str, decorator: Callable[[Any], Any], func: Any) -> Any:
    """``@decorator`` on ``func`` as if defined at module level as ``name``: parallelized
    functions travel by that name, and one process holds the program once per library."""
    func.__name__ = func.__qualname__ = name
    globals()[name] = wrapped = decorator(func)
    return wrapped


# ----- the program: TorchOpt's API only -------------------------------------------------------
def make_program(torchopt: ModuleType, todist: ModuleType, tag: str) -> SimpleNamespace:
    def adapt(original_net: nn.Module, x_spt: torch.Tensor, y_spt: torch.Tensor,
              x_qry: torch.Tensor, y_qry: torch.Tensor, n_inner_iter: int) -> torch.Tensor:
        net = torchopt.module_clone(original_net, by="reference", detach_buffers=True)
        inner_opt = torchopt.MetaSGD(net, lr=INNER_LR)
        for _ in range(n_inner_iter):
            inner_opt.step(F.cross_entropy(net(x_spt), y_spt))
        return F.cross_entropy(net(x_qry), y_qry)

    def inner_loop(net_rref: Any, x_spt: torch.Tensor, y_spt: torch.Tensor,
                   x_qry: torch.Tensor, y_qry: torch.Tensor, n_inner_iter: int) -> torch.Tensor:
        return adapt(net_rref.to_here(), x_spt, y_spt, x_qry, y_qry, n_inner_iter)

    inner_loop = module_level(f"{tag}_inner_loop", todist.parallelize(
        partitioner=todist.dim_partitioner(0, exclusive=True, keepdim=False),
        reducer=todist.mean_reducer), inner_loop)

    @todist.rank_zero_only
    def meta_step(net: nn.Module, meta_opt: torch.optim.Optimizer, step: int,
                  dtype: torch.dtype) -> float:
        x_spt, y_spt, x_qry, y_qry = sample_tasks(step, dtype)
        meta_opt.zero_grad()
        # Parameters pickled by RPC arrive detached: send a differentiable copy.
        net_rref = todist.rpc.RRef(torchopt.module_clone(net, by="copy"))
        with todist.autograd.context() as context_id:
            qry_loss = inner_loop(net_rref, x_spt, y_spt, x_qry, y_qry, CFG["inner_steps"])
            todist.autograd.backward(context_id, qry_loss)
            meta_opt.step()
        return float(qry_loss.item())

    @todist.rank_zero_only
    def train(steps: int, dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
        net = build_model(dtype)
        meta_opt, seconds = torch.optim.Adam(net.parameters(), lr=META_LR), []
        for step in range(steps):
            start = time.perf_counter()
            meta_step(net, meta_opt, step, dtype)
            seconds.append(time.perf_counter() - start)
        return seconds, {n: p.detach().clone() for n, p in net.named_parameters()}

    @todist.auto_init_rpc()
    def main(steps: int) -> Any:
        return train(steps, torch.float32)

    return SimpleNamespace(adapt=adapt, meta_step=meta_step, train=train, main=main)


# ----- metadist's own spmd engine: every rank drives, the module travels as it is -------------
def spmd_program(adapt: Callable[..., torch.Tensor]) -> SimpleNamespace:
    import metadist.mapreduce as mr

    parallel = module_level("spmd_inner_loop", mr.parallelize(
        partitioner=mr.dim_partitioner(0, exclusive=True, keepdim=False),
        reducer=mr.mean_reducer), adapt)

    def meta_step(net: nn.Module, meta_opt: torch.optim.Optimizer, step: int,
                  dtype: torch.dtype) -> float:
        tasks = sample_tasks(step, dtype)
        meta_opt.zero_grad()
        with mr.autograd.context() as context_id:
            qry_loss = parallel(net, *tasks, CFG["inner_steps"])
            mr.autograd.backward(context_id, qry_loss)
            meta_opt.step()
        return float(qry_loss.item())

    return SimpleNamespace(meta_step=meta_step)


def _libraries() -> dict[str, tuple[ModuleType, ModuleType]]:
    """Each implementation's ``torchopt`` and ``torchopt.distributed`` (TorchOpt's if found)."""
    import metadist.compat.torchopt.distributed

    libs = {COMPAT: (metadist.compat.torchopt, metadist.compat.torchopt.distributed)}
    try:
        import torchopt.distributed
    except ImportError:
        return libs
    return {TORCHOPT: (torchopt, torchopt.distributed), **libs}


# ----- same processes: meta-steps alternate ---------------------------------------------------
def _together(setting: dict[str, int], steps: int, warmup: int, check_steps: int,
              torch_rpc_defaults: bool) -> dict[str, Any]:
    from torch.distributed import rpc

    import metadist.mapreduce as mr

    use_peers()
    CFG.update(setting)
    mr.init("rpc", rpc_backend_options=rpc.TensorPipeRpcBackendOptions()
            if torch_rpc_defaults else None)  # RPC up once, for both libraries
    programs = {name: make_program(*mods, tag=name.split()[0].replace(".", "_"))
                for name, mods in _libraries().items()}
    programs[SPMD] = spmd_program(programs[COMPAT].adapt)
    rank0 = metadist.world().rank == 0

    def stepper(name: str, dtype: torch.dtype) -> tuple[Callable[[], object], nn.Module]:
        engine, net = ("spmd" if name == SPMD else "rpc"), build_model(dtype)
        meta_opt, count = torch.optim.Adam(net.parameters(), lr=META_LR), [0]

        def step() -> None:
            mr.init(engine)  # every rank; switches the engine, RPC stays up
            programs[name].meta_step(net, meta_opt, count[0], dtype)
            count[0] += 1

        return step, net

    seconds = alternate({n: stepper(n, torch.float32)[0] for n in programs}, steps, warmup)
    params = {}
    for name in programs:  # float64, from the same weights, on the same tasks
        step, net = stepper(name, torch.float64)
        for _ in range(check_steps):
            step()
        comm.barrier()
        params[name] = {n: p.detach().clone() for n, p in net.named_parameters()}
    mr.shutdown()
    return {"seconds": seconds, "params": params if rank0 else None}


# ----- whole runs: each library under its own auto_init_rpc() ---------------------------------
def rank_main() -> None:
    """One rank of one whole run (``python -c``; its settings as JSON in argv[1])."""
    cfg = json.loads(sys.argv[1])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks into the log on a hang
    torch.set_num_threads(1)
    use_peers()
    CFG.update(cfg["setting"])
    program = make_program(*_libraries()[cfg["impl"]], tag="run")
    try:
        result = program.main(cfg["steps"])
    except BaseException:  # the libraries' graceful shutdown would wait for the lost call
        traceback.print_exc()
        os._exit(1)
    if result is not None:  # rank 0
        torch.save(result[0], cfg["out"])


def launch(impl: str, world: int, setting: dict[str, int], steps: int,
           timeout: float) -> list[float]:
    """One whole run on ``world`` fresh processes; rank 0's seconds per meta-step."""
    from metadist.runtime.spawn import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "seconds.pt"
        arg = json.dumps({"impl": impl, "setting": setting, "steps": steps, "out": str(out)})
        env = {k: v for k, v in os.environ.items() if not k.startswith((
            "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "TORCHELASTIC_", "METADIST_"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), PYTHONPATH=os.pathsep.join(
                       p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
        logs, procs = [Path(tmp) / f"rank{r}.log" for r in range(world)], []
        for rank, log in enumerate(logs):
            with log.open("w") as sink:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", "from benchmarks.torchopt_compat import rank_main; "
                     "rank_main()", arg], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        deadline, codes = time.monotonic() + timeout, [proc.poll() for proc in procs]
        try:  # until all exit, one fails (the others would wait on it), or the deadline
            while time.monotonic() < deadline and None in codes and not any(codes):
                time.sleep(0.1)
                codes = [proc.poll() for proc in procs]
        finally:
            hung = [proc for proc in procs if proc.poll() is None]
            for proc in hung:
                proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0 if hung else 0.0)
            for proc in hung:
                proc.kill()
                proc.wait()
        if any(code != 0 for code in codes) or not out.is_file():
            tails = "\n".join(f"--- rank {r} ---\n" + "\n".join(
                log.read_text(errors="replace").splitlines()[-60:]) for r, log in enumerate(logs))
            raise RuntimeError(f"{impl} on {world} ranks failed (exit codes {codes}):\n{tails}")
        seconds: list[float] = torch.load(out)
        return seconds


def _whole_runs(impls: list[str], world: int, setting: dict[str, int],
                args: argparse.Namespace, failed: list[str]) -> dict[str, list[list[float]]]:
    """Per implementation, each run's timed seconds per meta-step (warm-up dropped)."""
    runs: dict[str, list[list[float]]] = {i: [] for i in impls}
    for r in range(args.rounds):
        for impl in rotation(impls, r):
            seconds = _retrying(f"whole run, {impl}, {world} ranks", failed, launch, impl,
                                world, setting, args.warmup + args.run_steps, args.timeout)
            runs[impl].append(seconds[args.warmup:])
    return runs


def _retrying(what: str, failed: list[str], fn: Callable[..., T], *args: Any,
              **kwargs: Any) -> T:
    """``fn(*args)``, again after a failure (twice at most; each is listed in the report):
    torch RPC on TCP alone stalls now and then here, whichever library drives it."""
    for attempt in range(3):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if attempt == 2:
                raise
            reason = next((ln for ln in str(exc).splitlines() if "RPCErr" in ln),
                          str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            failed.append(f"{what}: {reason.strip()[:300]}")
            print(f"  failed, run again: {failed[-1]}", flush=True)
    raise AssertionError("unreachable")


# ----- report ---------------------------------------------------------------------------------
def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
              skip: frozenset[str] = frozenset()) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a if k not in skip)


def _row(out: Results, setting: str, world: int, impl: str, mode: str, ms: float,
         ref_ms: float, extra: tuple[object, ...]) -> tuple[object, ...]:
    out.data["rows"].append({"setting": setting, "world": world, "implementation": impl,
                             "mode": mode, "ms": ms, "meta_steps_per_s": 1e3 / ms,
                             "tasks_per_s": TASKS * 1e3 / ms, "x_torchopt": ref_ms / ms,
                             "extra": list(extra)})
    return (world, impl, ms, 1e3 / ms, TASKS * 1e3 / ms, f"{ref_ms / ms:.2f}", *extra)


def _report(out: Results, name: str, args: argparse.Namespace, together: dict[int, Any],
            runs: dict[int, dict[str, list[list[float]]]]) -> None:
    """The setting's tables, printed once it is measured (a later failure keeps them)."""
    s = SETTINGS[name]
    what = (f"{TASKS} tasks x {s['inner_steps']} inner steps per meta-step, 5-way {s['k_spt']}"
            f"-shot, {s['k_qry']} query shots, {s['channels']} channels")
    rpc = "torch's default" if args.torch_rpc_defaults else "metadist's (TCP only)"
    out.heading(f"{name}: TorchOpt's MAML program ({what}), same processes, RPC with {rpc} "
                f"options, meta-steps alternating (medians of {args.steps})")
    rows = []
    for world, res in together.items():
        ms = {k: v * 1e3 for k, v in res["seconds"].items()}
        ref, params = ms.get(TORCHOPT, float("nan")), res["params"]
        for impl, impl_ms in ms.items():
            diffs = (("-", "-") if TORCHOPT not in params else tuple(f"{d:.1e}" for d in (
                _max_diff(params[impl], params[TORCHOPT]),
                _max_diff(params[impl], params[TORCHOPT], CONV_BIASES))))
            rows.append(_row(out, name, world, impl, "same processes", impl_ms, ref, diffs))
    out.table(["ranks", "implementation", "ms / meta-step", "meta-steps / s", "tasks / s",
               "x TorchOpt", f"max |param - TorchOpt| after {args.check_steps} steps (float64)",
               "same, conv biases left out"], rows, key=f"{name}_same_processes")
    out.note("(x TorchOpt: meta-steps per second over TorchOpt's. Conv biases feed BatchNorm: "
             "true gradient zero, float64 rounding (~1e-17) scaled by Adam's lr / eps = 1e5)\n")
    if not runs:
        return
    out.heading(f"{name}: whole runs, each library with its own RPC defaults (TorchOpt: "
                f"torch's; the drop-in: TCP only), runs alternating (medians over {args.rounds} "
                f"runs x {args.run_steps} meta-steps)")
    rows = []
    for world, by_impl in runs.items():
        med = {k: statistics.median(t for run in v for t in run) * 1e3
               for k, v in by_impl.items()}
        for impl, v in by_impl.items():
            spread = "-".join(f"{statistics.median(run) * 1e3:.0f}" for run in v)
            rows.append(_row(out, name, world, impl, "whole runs", med[impl],
                             med.get(TORCHOPT, float("nan")), (spread,)))
    out.table(["ranks", "implementation", "ms / meta-step", "meta-steps / s", "tasks / s",
               "x TorchOpt", "each run's median (ms)"], rows, key=f"{name}_whole_runs")


def main() -> None:
    use_peers()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="timed meta-steps, same processes")
    ap.add_argument("--warmup", type=int, default=2, help="meta-steps discarded first")
    ap.add_argument("--check-steps", type=int, default=3, help="float64 meta-steps compared")
    ap.add_argument("--rounds", type=int, default=2, help="whole runs per library (0: none)")
    ap.add_argument("--run-steps", type=int, default=5, help="timed meta-steps per whole run")
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--settings", default="conv,light", help=f"of: {', '.join(SETTINGS)}")
    ap.add_argument("--torch-rpc-defaults", action="store_true",
                    help="same processes: start RPC with torch's default options (TorchOpt's)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    output_args(ap)
    args = parse(ap, steps=2, warmup=1, check_steps=1, rounds=1, run_steps=2, worlds="2",
                 settings="light")
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    with Results("torchopt_compat", args) as out:  # JSON also of what ran before a failure
        impls = list(_libraries())
        if TORCHOPT not in impls:
            out.skip(TORCHOPT, "TorchOpt is not importable (`make bench` installs it into "
                     ".bench/; see benchmarks/mapreduce.py)")
        out.data = {"tasks": TASKS, "settings": SETTINGS, "rows": []}
        for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
            together, runs, failed = {}, {}, list[str]()
            for world in worlds:
                together[world] = _retrying(
                    f"same processes, {world} ranks", failed, metadist.launch, _together, world,
                    (SETTINGS[name], args.steps, args.warmup, args.check_steps,
                     args.torch_rpc_defaults), threads=1, timeout=args.timeout)[0]
                if args.rounds:
                    runs[world] = _whole_runs(impls, world, SETTINGS[name], args, failed)
            _report(out, name, args, together, runs)
            for line in failed:
                out.note(f"(failed and run again: {line})")


if __name__ == "__main__":  # run from the module's importable name: functions travel by it
    from benchmarks.torchopt_compat import main as entry

    entry()
