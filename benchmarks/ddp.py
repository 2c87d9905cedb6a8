"""metadist ddp vs torch DistributedDataParallel vs the no-communication bound.

    python -m benchmarks.ddp [--world 2] [--steps 12] [--workloads mlp,transformer]
                             [--device auto|cpu|cuda] [--json PATH] [--quick]

All three train identical copies of the model in the same processes, taking turns step by
step (warm-up discarded, medians). The bound is the same processes stepping locally with no
collective. Also reports collectives and bytes per step of metadist ddp against the ring
limit 2 P (N-1)/N, and writes a PNG of the step times. On cuda (NCCL, one GPU per rank) the
phases are timed with CUDA events.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import metadist
from benchmarks import device
from benchmarks.common import Results, output_args, parse, rotation, run_jobs, timed
from benchmarks.models import param_count, workload
from metadist.comm import stats

Phases = dict[str, list[Any]]  # seconds, or on cuda (start, end) events read after the run


def _clock(cuda: bool) -> Any:
    """A point in time: perf_counter on the CPU; on cuda an event recorded on the stream
    (the host returns before the GPU ran the phase; reading events waits for nothing)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(value: Any) -> float:
    """A phase's duration: as measured on the CPU, from its two events on cuda."""
    if isinstance(value, tuple):
        start, end = value
        return float(start.elapsed_time(end)) / 1e3
    return float(value)


def _stepper(model: nn.Module, opt: torch.optim.Optimizer, batches: list, loss_fn: Callable,
             backward: Callable[[torch.Tensor], None],  # type: ignore[type-arg]
             phases: Phases) -> Callable[[], None]:
    """One training step; also records this rank's forward / backward / step durations."""
    state = {"i": 0}
    cuda = device.on_cuda()

    def step() -> None:
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        t0 = _clock(cuda)
        loss = loss_fn(model(x), y)
        t1 = _clock(cuda)
        backward(loss)
        t2 = _clock(cuda)
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = _clock(cuda)
        for key, a, b in (("forward", t0, t1), ("backward", t1, t2), ("step", t2, t3)):
            phases.setdefault(key, []).append((a, b) if cuda else b - a)

    return step


def _body(name: str, steps: int, warmup: int, options: dict[str, float],
          quick: bool = False) -> dict[str, object]:
    factory, data, loss_fn = workload(name, quick)
    dev = device.here()
    batches = [(x.to(dev), y.to(dev)) for x, y in data(metadist.world().rank)]
    configs: dict[str, Callable[[], None]] = {}
    phases: dict[str, Phases] = {k: {} for k in ("no-comm bound", "torch DDP", "metadist ddp")}

    local = factory().to(dev)
    configs["no-comm bound"] = _stepper(local, torch.optim.Adam(local.parameters(), lr=1e-4),
                                        batches, loss_fn, lambda t: t.backward(),
                                        phases["no-comm bound"])
    ddp = device.ddp(factory())
    configs["torch DDP"] = _stepper(ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4), batches,
                                    loss_fn, lambda t: t.backward(), phases["torch DDP"])
    ours = factory()
    strategy = metadist.strategy("ddp", **options)
    model, opt = strategy.setup(ours, torch.optim.Adam(ours.parameters(), lr=1e-4))
    configs["metadist ddp"] = _stepper(model, opt, batches, loss_fn, strategy.backward,
                                       phases["metadist ddp"])

    samples: dict[str, list[float]] = {k: [] for k in configs}
    traffic = None
    for i in range(warmup + steps):
        for key in rotation(list(configs), i):
            step = configs[key]
            if key == "metadist ddp" and i == warmup:
                with stats.counting() as counted:
                    t = timed(step)
                traffic = counted
            else:
                t = timed(step)
            if i >= warmup:
                samples[key].append(t)
    assert traffic is not None
    return {"median": {k: statistics.median(v) for k, v in samples.items()},
            "phases": {k: {ph: statistics.median(_seconds(t) for t in v[warmup:])
                           for ph, v in p.items()}
                       for k, p in phases.items()},
            # The two barriers that bracket a timed step are the harness's, not the strategy's.
            "params": param_count(local),
            "calls": traffic.calls - traffic.ops.get("barrier", stats.OpStats()).calls,
            "bytes": traffic.ops["all_reduce"].bytes, "wire": traffic.wire_bytes,
            "ops": {op: {"calls": s.calls, "payload_bytes": s.bytes, "wire_bytes": s.wire_bytes}
                    for op, s in traffic.ops.items()}}


def _plot(results: dict[str, dict[str, object]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6))
    axes = axes if len(results) > 1 else [axes]
    for ax, (name, res) in zip(axes, results.items(), strict=True):
        medians = res["median"]
        assert isinstance(medians, dict)
        keys = list(medians)
        ax.bar(keys, [medians[k] * 1e3 for k in keys], color=["#999999", "#4c72b0", "#dd8452"])
        ax.set_title(f"{name} ({res['params'] / 1e6:.1f}M params)")
        ax.set_ylabel("ms / step (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


ROLES = {"no-comm bound": "bound", "torch DDP": "anchor", "metadist ddp": "metadist"}


def _data(results: dict[str, dict[str, Any]], n: int) -> dict[str, Any]:
    """The structured results: per workload, configurations with their role, ms and (ours)
    traffic against the ring limit, and the ratios the tables show."""
    out = {}
    for name, res in results.items():
        med, ring = res["median"], 2 * res["params"] * 4 * (n - 1) / n
        configs: dict[str, Any] = {
            k: {"role": ROLES[k], "ms": med[k] * 1e3,
                "phases_ms": {ph: v * 1e3 for ph, v in res["phases"][k].items()}}
            for k in med}
        configs["metadist ddp"]["traffic"] = {
            "calls": res["calls"], "payload_bytes": res["bytes"], "wire_bytes": res["wire"],
            "ring_limit_bytes": ring, "wire_over_limit": res["wire"] / ring, "ops": res["ops"]}
        ratios = [{"config": a, "reference": b, "ratio": med[a] / med[b]}
                  for a, b in (("metadist ddp", "torch DDP"), ("torch DDP", "no-comm bound"),
                               ("metadist ddp", "no-comm bound"))]
        out[name] = {"params": res["params"], "configs": configs, "ratios": ratios}
    return {"world": n, "workloads": out}


def _report(out: Results, results: dict[str, dict[str, Any]], n: int, steps: int,
            warmup: int) -> None:
    out.heading(f"ddp step time, world size {n}, {device.where(n)}, Adam "
                f"(medians of {steps}, alternating, {warmup} warm-up steps discarded)")
    rows = []
    for name, res in results.items():
        med = res["median"]
        bound, torch_ddp, ours = med["no-comm bound"], med["torch DDP"], med["metadist ddp"]
        rows.append((f"{name} ({res['params'] / 1e6:.1f}M)", bound * 1e3, torch_ddp * 1e3,
                     ours * 1e3, ours / torch_ddp, torch_ddp / bound, ours / bound))
    out.table(["workload", "no-comm ms", "torch DDP ms", "metadist ddp ms",
               "ours / torch", "torch / bound", "ours / bound"], rows, key="step_time")
    rows = []
    for name, res in results.items():
        for config, ph in res["phases"].items():
            rows.append((name, config, ph["forward"] * 1e3, ph["backward"] * 1e3,
                         ph["step"] * 1e3))
    out.table(["workload", "configuration", "forward ms", "backward ms (incl. sync)",
               "optimizer ms"], rows, key="phases")
    rows = []
    for name, res in results.items():
        ring = 2 * res["params"] * 4 * (n - 1) / n
        rows.append((name, res["calls"], res["bytes"] / 2**20, res["wire"] / 2**20, ring / 2**20,
                     res["wire"] / ring))
    out.table(["workload", "collectives / step", "payload MiB", "wire MiB (ring model)",
               "ring limit 2P(N-1)/N MiB", "wire / limit"], rows, key="traffic")
    out.data = _data(results, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="steps discarded first")
    ap.add_argument("--workloads", default="mlp,transformer", help="comma-separated")
    ap.add_argument("--plot", default=None,
                    help="PNG of the step times (default docs/figures/ddp_step_time.png, none "
                         "under --quick; '' for none)")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    device.add_args(ap)
    output_args(ap)
    args = parse(ap, steps=2, warmup=1, plot="")
    device.resolve(args)
    if args.plot is None:
        args.plot = "docs/figures/ddp_step_time.png"
    with Results("ddp", args) as out:  # JSON also of what ran before a failure
        names = args.workloads.split(",")
        options = {"bucket_cap_mb": args.bucket_cap_mb}
        jobs = [(name, args.steps, args.warmup, options, args.quick) for name in names]
        results = dict(zip(names, run_jobs(_body, jobs, args.world, args.quick, timeout=1800),
                           strict=True))
        _report(out, results, args.world, args.steps, args.warmup)
        if args.plot:
            os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
            _plot(results, args.plot)
            print(f"plot: {args.plot}")  # the report embeds it: no note there
            out.data["plots"] = {"step times": os.path.abspath(args.plot)}


if __name__ == "__main__":
    main()
