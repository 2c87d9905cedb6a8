"""Second-order meta-learning beyond one rank's memory: per-rank peak of a meta-step.

    python -m benchmarks.sharded_meta [--width 2048] [--depth 6] [--batch 32] [--steps 5]
                                      [--warmup 2] [--allocator metadist|default]
                                      [--json PATH] [--quick]

The workload: an MLP of ``depth`` Linear(width, width) + tanh layers (width 2048, depth 6:
96 MiB of float32 parameters), one inner problem whose global batch is split over the ranks,
3 unrolled SGD steps with create_graph=True, the outer loss, backward and the optimizer's
step. Three ways, each at N = 1, 2 and 4 ranks (gloo, 1 thread per rank):

* ddp, gathered: ``full_parameters()`` + ``functional_forward`` (everything whole);
* zero3, gathered: the same lines under zero3 (``wrap_classes=(nn.Linear,)``);
* zero3, sharded: ``model.fast_weights()`` (strategies/zero3/sharded_fast.py); and hsdp 2 x 2.

Memory is the growth of each rank's peak during one meta-step, two ways: bytes of live
storages (allocations seen by a dispatch mode; stable under load) and resident memory (the
kernel's high-water mark, reset before the step, under metadist's allocator setting, which
makes it follow the tensors (runtime/resident.py); ``--allocator default`` keeps glibc's and
torch's defaults). The bound is issue 28's:
1.2 x (ddp's growth at N = 1) / N + twice the largest unit's full size. Time: medians of
``--steps`` meta-steps of each path in two processes of its own, then over ``--rounds``
launches taking turns (see :func:`_time_body` for why not alternating steps).
Traffic: the collectives one sharded meta-step issues, by kind, against the count the
mechanism implies (see :func:`_expected_calls`), and bytes each rank sends against the ring
model.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

import metadist
from benchmarks.common import Results, output_args, parse, rotation, timed
from metadist.comm import stats
from metadist.runtime import resident
from metadist.testing import bytes_kept_by, peak_bytes_of

K, LR = 3, 0.1
MIB = 2**20
WRAP = {"wrap_classes": (nn.Linear,)}


def _net(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean()


def _set_up(strategy: str, width: int, depth: int, batch: int, prefetch: bool = True
            ) -> tuple[Any, ...]:
    options = {**WRAP, "prefetch": prefetch} if strategy in ("zero3", "hsdp") else {}
    s = metadist.strategy(strategy, **options)
    net = _net(width, depth)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    return s, model, opt, x, y


def _step(s: Any, model: Any, opt: Any, x: Tensor, y: Tensor, path: str) -> None:
    """One meta-step: K inner SGD steps on this rank's slice, the outer loss, the step."""
    opt.zero_grad(set_to_none=False)
    if path == "sharded":
        fast = model.fast_weights()
        xs, ys = (t.chunk(fast.group_size)[fast.group_rank] for t in (x, y))
        for _ in range(K):
            fast = fast - LR * fast.grad(_mse(model.functional_forward(fast, xs), ys))
        s.backward(_mse(model.functional_forward(fast, xs), ys))
    else:
        w = metadist.world()
        xs, ys = (t.chunk(w.world_size)[w.rank] for t in (x, y))
        params = model.full_parameters()
        for _ in range(K):
            inner = _mse(model.functional_forward(params, xs), ys)
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            params = {n: p - LR * d for (n, p), d in zip(params.items(), grads, strict=True)}
        s.backward(_mse(model.functional_forward(params, xs), ys))
    opt.step()


@contextmanager
def _allocator(setting: str) -> Iterator[None]:
    """``"metadist"``: the ranks as metadist sets them up (runtime/resident.py: resident
    memory follows the tensors); ``"default"``: glibc's and torch's own behaviour
    (``METADIST_ALLOCATOR=default``), as a program that turns metadist's setting off meets
    them."""
    if setting != "default":
        yield
        return
    saved = {k: os.environ.get(k) for k in (resident.ENV, "THP_MEM_ALLOC_ENABLE")}
    os.environ[resident.ENV] = "default"  # read by each rank when it imports metadist
    if "torch huge pages" in resident.setting():
        os.environ.pop("THP_MEM_ALLOC_ENABLE", None)  # this process's, not the user's
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _setting_words(setting: str) -> str:
    """The allocator a ``--allocator`` choice runs the ranks under, in words."""
    if setting == "default":
        return "glibc and torch defaults (METADIST_ALLOCATOR=default)"
    return resident.setting()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> bool:
    try:  # Linux: "5" resets the high-water mark to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_body(strategy: str, path: str, width: int, depth: int, batch: int
                 ) -> dict[str, float]:
    """Rank-wise growth of one meta-step: resident memory over the first one after setup
    (the issue's measure), live storages over the second (gradients exist, as in
    training); and the bytes of storages that two more meta-steps leave alive (what a long
    run would accumulate: nothing)."""
    s, model, opt, x, y = _set_up(strategy, width, depth, batch)
    # resident: the first meta-step after setup (later ones reuse what the allocator kept)
    before = _status_kib("VmRSS")
    reset = _reset_peak_rss()
    _step(s, model, opt, x, y, path)
    peak_kib = (_status_kib("VmHWM") if reset
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    rss = max(peak_kib - before, 0) * 1024
    live = peak_bytes_of(lambda: _step(s, model, opt, x, y, path))[1]

    def two_steps() -> None:
        for _ in range(2):
            _step(s, model, opt, x, y, path)

    kept = bytes_kept_by(two_steps)[1]
    mine = torch.tensor([live, rss, kept], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(metadist.world().world_size)]
    if metadist.world().world_size > 1:
        torch.distributed.all_gather(every, mine)
    else:
        every = [mine]
    return {"live_max": max(float(t[0]) for t in every) / MIB,
            "live_min": min(float(t[0]) for t in every) / MIB,
            "rss_max": max(float(t[1]) for t in every) / MIB,
            "rss_min": min(float(t[1]) for t in every) / MIB,
            "kept_max": max(float(t[2]) for t in every) / MIB}


def _time_body(path: str, width: int, depth: int, batch: int, steps: int, warmup: int
               ) -> dict[str, Any]:
    """The median of ``steps`` meta-steps of one path, in processes of its own; for the
    sharded path also the collectives of one meta-step. (The two paths do not take turns in
    the same processes: each leaves the C allocator's heap in a state that moves the other's
    page faults, measured at 10-20% of either's time in opposite directions, which made the
    ratio look better than either path alone.)"""
    strategy = "ddp" if path == "ddp" else "zero3"
    s, model, opt, x, y = _set_up(strategy, width, depth, batch, prefetch=path != "serial")
    path = {"serial": "sharded", "ddp": "gathered"}.get(path, path)
    for _ in range(warmup):
        _step(s, model, opt, x, y, path)
    times = sorted(timed(lambda: _step(s, model, opt, x, y, path)) for _ in range(steps))
    ops = {}
    if path == "sharded":
        with stats.counting() as counted:
            _step(s, model, opt, x, y, path)
        ops = {op: {"calls": o.calls, "bytes": o.bytes, "wire_bytes": o.wire_bytes}
               for op, o in counted.ops.items()}
    return {"time": statistics.median(times), "ops": ops}


def _times(args: argparse.Namespace, batch: int
           ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Each path's launch medians over ``--rounds`` launches, the paths' launches taking
    turns."""
    samples: dict[str, list[float]] = {p: [] for p in args.paths.split(",")}
    ops: dict[str, dict[str, Any]] = {}
    for i in range(args.rounds):
        for path in rotation(list(samples), i):
            res = metadist.launch(_time_body, 2, args=(path, args.width, args.depth, batch,
                                                       args.steps, args.warmup),
                                  threads=1, timeout=3000)[0]
            samples[path].append(res["time"])
            ops[path] = res["ops"] or ops.get(path, {})
    return samples, ops


def _expected_calls(units: int, saved: int, turns: int = 0) -> dict[str, int]:
    """Collectives of one sharded meta-step with K inner steps, for ``units`` units of which
    ``saved`` have a weight autograd saves (a Linear's weight is saved for the gradient of
    its input; the first layer's input needs none). All-gathers: every unit in each of the
    K + 1 forwards and, in the outer backward, for each recorded reduce-scatter's gradient
    (K); every saved weight again when a backward reads it: the K inner backwards, and the
    outer backward through the K + 1 forwards and the K recorded backwards.
    Reduce-scatters: every unit's gradient in the K inner backwards and of the K + 1
    forwards in the outer one, and each saved weight's K second-order gradients.
    ``turns``: reads served by a gather made before them (with prefetch,
    strategies/zero3/fast_ahead.py): each forward's last unit kept for the backward that follows
    it (K + 1), and where the outer backward turns from an inner step's recorded backward to
    its forward, on the same weight (K)."""
    gathers = (K + 1) * units + K * units + (K + K + 1 + K) * saved - turns
    scatters = K * units + (K + 1) * units + K * saved
    return {"all_gather": gathers, "reduce_scatter": scatters}


def _largest(out: Results, mem: dict[tuple[str, str, int], dict[str, float]], params: int,
             budget_gib: float) -> list[dict[str, Any]]:
    """The largest model of this shape (depth fixed, width grown: every term scales with
    the parameter count) whose meta-step growth fits ``budget_gib`` per rank: ddp from its
    N = 1 growth per parameter, sharded from the fit growth(N) = (a / N + c) x parameters
    through the N = 2 and N = 4 measurements."""
    per_param = {n: mem[("zero3", "sharded", n)]["live_max"] * MIB / params for n in (2, 4)}
    a = (per_param[2] - per_param[4]) * 4  # bytes per parameter that divide by N
    c = per_param[4] - a / 4  # and that do not (units whole, activations)
    ddp = mem[("ddp", "gathered", 1)]["live_max"] * MIB / params
    budget = budget_gib * 2**30
    rows, records = [], []
    for label, n, per in (("ddp, gathered", 1, ddp), ("zero3, sharded", 4, a / 4 + c),
                          ("zero3, sharded (fit)", 8, a / 8 + c),
                          ("zero3, sharded (fit)", 16, a / 16 + c)):
        largest = budget / per
        rows.append((label, n, f"{per:.1f}", f"{largest / 1e9:.2f}"))
        records.append({"configuration": label, "ranks": n, "bytes_per_parameter": per,
                        "largest_parameters": largest})
    out.heading(f"the largest model of this shape a {budget_gib:g} GiB rank meta-trains "
                f"({K} inner steps, create_graph)")
    out.table(["configuration", "ranks", "growth bytes per parameter", "largest model "
               "G parameters"], rows, key="largest")
    out.note(f"sharded fit: growth(N) = ({a:.1f} / N + {c:.1f}) bytes per parameter, "
             "through the N = 2 and N = 4 rows above; (fit) rows extrapolate it")
    return records


def _memory_tables(out: Results, args: argparse.Namespace) -> None:
    """Per-rank peak growth of each configuration, and the largest model a budget allows."""
    shape = (args.width, args.depth, args.batch)
    params = args.depth * args.width * (args.width + 1)
    unit_mib = args.width * (args.width + 1) * 4 / MIB
    runs = [("ddp", "gathered", n, 1) for n in (1, 2, 4)]
    runs += [("zero3", path, n, 1) for path in ("gathered", "sharded") for n in (1, 2, 4)]
    runs += [("hsdp", "sharded", 4, 2)]
    mem = {}
    with _allocator(args.allocator):
        for strategy, path, n, nodes in runs:
            mem[(strategy, path, n)] = metadist.launch(
                _memory_body, n, args=(strategy, path, *shape), threads=1, nnodes=nodes,
                timeout=3000)[0]
    one = mem[("ddp", "gathered", 1)]["rss_max"]
    one_live = mem[("ddp", "gathered", 1)]["live_max"]
    out.heading(f"per-rank peak growth of one meta-step: MLP {args.depth} x {args.width} "
                f"({params * 4 / MIB:.0f} MiB float32), {K} inner steps with create_graph, "
                f"global batch {args.batch}, gloo, 1 thread per rank, allocator: "
                f"{_setting_words(args.allocator)}")
    rows: list[tuple[Any, ...]] = []
    records = []
    for (strategy, path, n), m in mem.items():
        factor = 2 if strategy == "hsdp" else n
        bound = 1.2 * one_live / factor + 2 * unit_mib
        label = "2 x 2" if strategy == "hsdp" else str(n)
        rows.append((strategy, path, label, f"{m['rss_min']:.0f}-{m['rss_max']:.0f}",
                     f"{m['live_min']:.0f}-{m['live_max']:.0f}", f"{bound:.0f}",
                     "yes" if m["live_max"] <= bound else "no", f"{m['kept_max']:.1f}"))
        records.append({"strategy": strategy, "path": path, "ranks": label,
                        "rss_mib": [m["rss_min"], m["rss_max"]],
                        "live_mib": [m["live_min"], m["live_max"]], "bound_mib": bound,
                        "kept_mib": m["kept_max"]})
    out.table(["strategy", "fast weights", "ranks", "resident growth MiB (min-max rank)",
               "live storages MiB (min-max rank)", "bound MiB (live)", "within",
               "MiB left alive by 2 more meta-steps (max rank)"],
              rows, key="memory")
    out.note(f"bound: 1.2 x (ddp's live growth at N = 1: {one_live:.0f} MiB) / N + twice "
             f"the largest unit ({unit_mib:.1f} MiB each); hsdp at its shard factor 2. "
             f"ddp's resident growth at N = 1: {one:.0f} MiB.")
    out.data["memory"] = records
    out.data["largest"] = _largest(out, mem, params, args.budget_gib)


def ratios_names(paths: list[str], bases: list[str]) -> list[str]:
    return [f"{p} / {b}" for b in bases for p in paths if p not in bases]


def _time_tables(out: Results, args: argparse.Namespace) -> None:
    """The N = 2 meta-step times of both paths, and the collectives of a sharded one."""
    rows: list[tuple[Any, ...]] = []
    timing = []
    paths = args.paths.split(",")
    bases = [b for b in ("ddp", "gathered") if b in paths]
    for batch in (int(b) for b in args.time_batches.split(",")):
        launches, ops = _times(args, batch)
        t = {path: statistics.median(ts) for path, ts in launches.items()}
        spread = "; ".join(f"{path} {min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f}"
                           for path, ts in launches.items())
        ratios = {f"{p}/{b}": t[p] / t[b] for b in bases for p in paths if p not in bases}
        rows.append((batch, *(f"{t[p] * 1e3:.0f}" for p in paths),
                     *(f"{r:.2f}" for r in ratios.values()), spread))
        timing.append({"batch": batch, **{f"{p}_ms": t[p] * 1e3 for p in paths},
                       "ratios": ratios,
                       "launch_ms": {p: [x * 1e3 for x in ts] for p, ts in launches.items()}})
    out.heading(f"meta-step time at N = 2 (each path in its own processes: medians of "
                f"{args.steps} steps, then of {args.rounds} launches taking turns; ddp: "
                f"the gathered lines under ddp; gathered: the same lines under zero3; "
                f"serial: sharded with prefetch=False, every gather waited where it is "
                f"needed)")
    out.table(["global batch", *(f"{p} ms" for p in paths),
               *(f"time ratio {b}" for b in ratios_names(paths, bases)),
               "launch medians ms (min-max)"], rows, key="time")
    out.data["time"] = timing
    expected = {path: _expected_calls(args.depth, args.depth - 1,
                                      2 * K + 1 if path == "sharded" else 0)
                for path in ("sharded", "serial")}
    unit_bytes = args.width * (args.width + 1) * 4
    rows = []
    for path in ("sharded", "serial"):
        for op, o in sorted(ops.get(path, {}).items()):
            want = expected[path].get(op)
            ring = (want * unit_bytes / 2 if want is not None else None)  # (N-1)/N at N = 2
            rows.append((path, op, o["calls"], want if want is not None else "-",
                         f"{o['wire_bytes'] / MIB:.0f}",
                         f"{ring / MIB:.0f}" if ring is not None else "-"))
    out.heading("collectives of one sharded meta-step at N = 2 (a gather started ahead "
                "that was not used would show as calls over the formula)")
    out.table(["path", "collective", "calls / meta-step", "calls / meta-step by the formula",
               "MiB sent per rank (ring model)", "MiB for those calls' unit payloads"],
              rows, key="traffic")
    out.data["traffic"] = {"ops": ops, "expected_calls": expected}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="the inner problem's global batch")
    ap.add_argument("--time-batches", default="32,256,512",
                    help="global batches the time comparison runs at (compute grows with the "
                         "batch, the collectives do not)")
    ap.add_argument("--steps", type=int, default=5, help="timed meta-steps per path")
    ap.add_argument("--budget-gib", type=float, default=16.0,
                    help="per-rank memory for the largest-model table")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="launches per path for the times")
    ap.add_argument("--paths", default="sharded,serial,gathered,ddp",
                    help="the time comparison's paths: sharded and gathered, and serial "
                         "(sharded with prefetch=False)")
    ap.add_argument("--allocator", choices=("metadist", "default"), default="metadist",
                    help="the ranks' C allocator: as metadist sets it (resident memory "
                         "follows the tensors, runtime/resident.py) or glibc's and torch's "
                         "defaults (METADIST_ALLOCATOR=default)")
    ap.add_argument("--parts", default="memory,time",
                    help="which tables: memory (and the largest model), time (and traffic)")
    output_args(ap)
    args = parse(ap, width=256, steps=2, warmup=1, time_batches="32", rounds=1)
    with Results("sharded_meta", args) as out:
        if "memory" in args.parts:
            _memory_tables(out, args)
        if "time" in args.parts:
            _time_tables(out, args)


if __name__ == "__main__":
    main()
