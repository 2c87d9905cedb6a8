"""The sharded meta-step a user can afford: its time against ddp's and its resident memory.

    python -m benchmarks.affordable_meta [--models mlp,gpt2] [--width 2048] [--depth 6]
                                         [--batch 32] [--ranks 2,4] [--steps 5] [--warmup 2]
                                         [--rounds 3] [--time-allocators metadist,default]
                                         [--json PATH] [--quick]

Two programs, each a second-order meta-step (3 unrolled SGD steps with create_graph, the
outer loss, backward, the optimizer's step) written two ways: ddp with ``full_parameters()``
and zero3 with ``model.fast_weights()``:

* ``mlp``: benchmarks/sharded_meta.py's MLP (``--depth`` x ``--width``, global batch
  ``--batch``), one unit per Linear;
* ``gpt2``: HuggingFace GPT-2 from a config (4 blocks x 256, 64 tokens, vocabulary 8192,
  eager attention: the default SDPA has no double backward on the CPU), a language-modelling
  loss on a global batch of 8 sequences, one unit per block.

* **Time**, at each of ``--ranks``: each path's median of ``--steps`` meta-steps in processes
  of its own, over ``--rounds`` launches taking turns (medians). Beside it, the time of the
  same collectives alone (each path's collectives of one meta-step, counted, then replayed
  with nothing else running): where the ranks' compute and their exchanges cannot overlap
  (on this machine each rank's compute holds a core, and a loopback exchange needs a core
  too), the sharded path cannot be faster than ddp's compute plus its own collectives, the
  bound the table states. A second table gives the CPU time of a meta-step over all ranks
  (user and system, every thread) and of the collectives alone: where more ranks than cores
  keep the cores busy, time is CPU shared out, and the CPU bound says what the sharded path's
  collectives alone add to ddp's.
* **Resident memory**: the growth of each rank's resident peak over the first meta-step after
  setup (the kernel's high-water mark), under metadist's allocator setting
  (runtime/resident.py) and under glibc's and torch's defaults, next to the live storages.

The targets: zero3 time at most 1.5 x ddp's at each N; zero3's resident growth at N = 2 at
most ddp's at N = 2, at N = 4 at most 0.35 x one process's (ddp at N = 1).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import metadist
from benchmarks import sharded_meta as sm
from benchmarks.common import Results, output_args, parse, rotation, timed
from metadist.comm import ops, stats
from metadist.testing import peak_bytes_of

PATHS = {"ddp": ("ddp", "gathered"), "zero3": ("zero3", "sharded")}
GPT2 = {"layers": 4, "width": 256, "seq": 64, "vocab": 8192, "batch": 8}


def _gpt2_set_up(strategy: str) -> tuple[Any, ...]:
    from benchmarks import real_models as rm

    net = rm.gpt2(GPT2)
    net.config._attn_implementation = "eager"
    block = rm._transformers().models.gpt2.modeling_gpt2.GPT2Block
    s = metadist.strategy(strategy, **({"wrap_classes": (block,)} if strategy == "zero3"
                                       else {}))
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    ids, query = (torch.randint(0, GPT2["vocab"], (GPT2["batch"], GPT2["seq"]), generator=g)
                  for _ in range(2))
    return s, model, opt, ids, query


def _gpt2_step(s: Any, model: Any, opt: Any, ids: Tensor, query: Tensor, path: str) -> None:
    from benchmarks.real_models import _lm_loss

    opt.zero_grad(set_to_none=False)
    if path == "sharded":
        fast = model.fast_weights()
        a, b = (t.chunk(fast.group_size)[fast.group_rank] for t in (ids, query))
        for _ in range(sm.K):
            fast = fast - sm.LR * fast.grad(_lm_loss(model.functional_forward(fast, a), a))
        s.backward(_lm_loss(model.functional_forward(fast, b), b))
    else:
        w = metadist.world()
        a, b = (t.chunk(w.world_size)[w.rank] for t in (ids, query))
        params = model.full_parameters()
        for _ in range(sm.K):
            inner = _lm_loss(model.functional_forward(params, a), a)
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            params = {n: p - sm.LR * d for (n, p), d in zip(params.items(), grads, strict=True)}
        s.backward(_lm_loss(model.functional_forward(params, b), b))
    opt.step()


def _program(model: str, kind: str, shape: tuple[int, int, int]) -> Callable[[], None]:
    """One meta-step of ``model`` set up the ``kind`` way (ddp or zero3)."""
    strategy, path = PATHS[kind]
    if model == "gpt2":
        s, net, opt, x, y = _gpt2_set_up(strategy)
        return lambda: _gpt2_step(s, net, opt, x, y, path)
    width, depth, batch = shape
    s, net, opt, x, y = sm._set_up(strategy, width, depth, batch)
    return lambda: sm._step(s, net, opt, x, y, path)


def _cpu_seconds() -> float:
    """CPU time this process (every thread: gloo's too) has used, user and system."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _replay(counted: dict[str, tuple[int, int]]) -> tuple[float, float]:
    """Seconds the collectives ``counted`` (op: calls, payload bytes in all) take alone, and
    the CPU seconds this rank spends on them."""
    n = metadist.world().world_size
    work = []
    for op, (calls, nbytes) in counted.items():
        per = -(-nbytes // (4 * calls * n)) * n  # float32 elements a call, split over n
        whole = torch.zeros(per)
        if op == "all_gather":
            mine = whole.narrow(0, 0, per // n).clone()
            work += [lambda w=whole, m=mine: ops.all_gather(w, m)] * calls
        elif op == "reduce_scatter":
            out = torch.empty(per // n)
            work += [lambda w=whole, o=out: ops.reduce_scatter(o, w, input_is_scratch=True)
                     ] * calls
        else:  # all_reduce, and any other by its payload
            work += [lambda w=whole: ops.all_reduce(w)] * calls

    def run() -> None:
        for call in work:
            call()

    run()  # warm-up: the connections' buffers
    cpu = _cpu_seconds()
    wall = statistics.median(timed(run) for _ in range(3))
    return wall, (_cpu_seconds() - cpu) / 3


def _time_body(model: str, path: str, shape: tuple[int, int, int], steps: int, warmup: int
               ) -> dict[str, float]:
    step = _program(model, path, shape)
    for _ in range(warmup):
        step()
    cpu = _cpu_seconds()
    t = statistics.median(timed(step) for _ in range(steps))
    cpu = (_cpu_seconds() - cpu) / steps
    with stats.counting() as counted:
        step()
    alone, alone_cpu = _replay({op: (o.calls, o.bytes) for op, o in counted.ops.items()})
    # CPU seconds of all ranks together: with more ranks than cores, time is what they share
    used = torch.tensor([cpu, alone_cpu], dtype=torch.float64)
    if metadist.world().world_size > 1:
        torch.distributed.all_reduce(used)
    return {"time": t, "collectives": alone, "cpu": float(used[0]),
            "collectives_cpu": float(used[1])}


def _memory_body(model: str, path: str, shape: tuple[int, int, int]) -> dict[str, float]:
    """The growth of this rank's resident peak over the first meta-step after setup, and
    its live storages' over the second; the most of any rank."""
    step = _program(model, path, shape)
    before = sm._status_kib("VmRSS")
    reset = sm._reset_peak_rss()
    step()
    peak = sm._status_kib("VmHWM") if reset else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss
    live = peak_bytes_of(step)[1]
    mine = torch.tensor([max(peak - before, 0) / 1024, live / 2**20], dtype=torch.float64)
    if metadist.world().world_size > 1:
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    return {"rss": float(mine[0]), "live": float(mine[1])}


def _shape(args: argparse.Namespace) -> tuple[int, int, int]:
    return args.width, args.depth, args.batch


def _times(args: argparse.Namespace, model: str, n: int, setting: str
           ) -> dict[str, dict[str, float]]:
    """Per path: the median over launches of its meta-step and its collectives alone."""
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
    with sm._allocator(setting):
        for i in range(args.rounds):
            for path in rotation(list(PATHS), i):
                samples[path].append(metadist.launch(
                    _time_body, n, args=(model, path, _shape(args), args.steps, args.warmup),
                    threads=1, timeout=3000)[0])
    return {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for p, rs in samples.items()}


def _memory(args: argparse.Namespace, model: str, setting: str
            ) -> dict[tuple[str, int], dict[str, float]]:
    out = {}
    with sm._allocator(setting):
        for path, n in (("ddp", 1), ("ddp", 2), ("zero3", 2), ("zero3", 4)):
            out[(path, n)] = metadist.launch(_memory_body, n, args=(model, path, _shape(args)),
                                             threads=1, timeout=3000)[0]
    return out


def _verdict(value: float, target: float) -> str:
    return "yes" if value <= target else f"no (x{value / target:.2f} the target)"


def _cpu_row(n: int, setting: str, d: dict[str, float], z: dict[str, float]
             ) -> tuple[object, ...]:
    """CPU seconds of a meta-step over all ranks, and how busy they kept the cores: where
    the ranks outnumber the cores and keep them busy, time follows CPU, and the sharded
    path's collectives cost CPU (loopback copies, wake-ups) that cannot hide."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    bound = (d["cpu"] - d["collectives_cpu"] + z["collectives_cpu"]) / d["cpu"]
    return (n, sm._setting_words(setting), f"{d['cpu'] * 1e3:.0f}",
            f"{d['cpu'] / (cores * d['time']):.2f}", f"{z['cpu'] * 1e3:.0f}",
            f"{z['cpu'] / (cores * z['time']):.2f}", f"{z['collectives_cpu'] * 1e3:.0f}",
            f"{z['cpu'] / d['cpu']:.2f}", f"{bound:.2f}")


def _time_table(out: Results, args: argparse.Namespace, model: str, name: str) -> None:
    rows, records, cpu_rows = [], [], []
    for n in (int(r) for r in args.ranks.split(",")):
        for setting in args.time_allocators.split(","):
            t = _times(args, model, n, setting)
            d, z = t["ddp"], t["zero3"]
            bound = (d["time"] - d["collectives"] + z["collectives"]) / d["time"]
            ratio = z["time"] / d["time"]
            rows.append((n, sm._setting_words(setting), f"{d['time'] * 1e3:.0f}",
                         f"{d['collectives'] * 1e3:.0f}", f"{z['time'] * 1e3:.0f}",
                         f"{z['collectives'] * 1e3:.0f}", f"{ratio:.2f}", f"{bound:.2f}",
                         _verdict(ratio, 1.5)))
            records.append({"ranks": n, "allocator": sm._setting_words(setting), "ddp": d,
                            "zero3": z, "ratio": ratio, "no_overlap_bound": bound})
            cpu_rows.append(_cpu_row(n, setting, d, z))
    out.heading(f"meta-step time, zero3 fast_weights() against ddp: {name}, gloo, 1 thread "
                f"per rank, {os.cpu_count()} cores")
    out.table(["ranks", "allocator", "ddp ms", "ddp's collectives alone ms", "zero3 ms",
               "zero3's collectives alone ms", "time ratio zero3 / ddp",
               "bound without overlap (ddp - its collectives + zero3's) / ddp",
               "within 1.5"], rows, key=f"time_{model}")
    out.data[f"time_{model}"] = records
    out.table(["ranks", "allocator", "ddp CPU ms (all ranks)", "ddp cores busy",
               "zero3 CPU ms (all ranks)", "zero3 cores busy",
               "zero3's collectives alone CPU ms", "CPU ratio zero3 / ddp",
               "CPU bound (ddp - its collectives + zero3's) / ddp"], cpu_rows,
              key=f"cpu_{model}")


def _memory_table(out: Results, args: argparse.Namespace, model: str, name: str) -> None:
    rows, records = [], []
    for setting in ("metadist", "default"):
        m = _memory(args, model, setting)
        one, ddp2 = m[("ddp", 1)]["rss"], m[("ddp", 2)]["rss"]
        z2, z4 = m[("zero3", 2)]["rss"], m[("zero3", 4)]["rss"]
        words = sm._setting_words(setting)
        rows.append((words, f"{one:.0f}", f"{ddp2:.0f}", f"{z2:.0f}", f"{z4:.0f}",
                     f"{m[('zero3', 4)]['live']:.0f}", f"{z2 / ddp2:.2f}",
                     _verdict(z2, ddp2), f"{z4 / one:.2f}", _verdict(z4, 0.35 * one)))
        records.append({"allocator": words, **{f"{p}_{n}": v for (p, n), v in m.items()}})
    out.heading(f"resident peak growth of the first meta-step after setup: {name} (MiB, "
                f"the rank that grew most)")
    out.table(["allocator", "ddp N=1", "ddp N=2", "zero3 N=2", "zero3 N=4",
               "zero3 N=4 live storages", "zero3 / ddp at N=2", "within 1.0",
               "zero3 N=4 / one process", "within 0.35"], rows, key=f"memory_{model}")
    out.data[f"memory_{model}"] = records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,gpt2", help="the programs: mlp, gpt2")
    ap.add_argument("--width", type=int, default=2048, help="the MLP's width")
    ap.add_argument("--depth", type=int, default=6, help="the MLP's layers")
    ap.add_argument("--batch", type=int, default=32, help="the MLP's global inner batch")
    ap.add_argument("--ranks", default="2,4", help="world sizes the times are taken at")
    ap.add_argument("--steps", type=int, default=5, help="timed meta-steps per launch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="launches per path, taking turns")
    ap.add_argument("--time-allocators", default="metadist,default",
                    help="the allocator settings the times are taken under: metadist "
                         "(runtime/resident.py), default (METADIST_ALLOCATOR=default)")
    ap.add_argument("--parts", default="time,memory", help="which tables: time, memory")
    output_args(ap)
    args = parse(ap, width=256, steps=2, warmup=1, rounds=1, ranks="2", models="mlp",
                 time_allocators="metadist")
    started = time.perf_counter()
    with Results("affordable_meta", args) as out:
        for model in args.models.split(","):
            name = _program_name(model, args)
            if "time" in args.parts:
                _time_table(out, args, model, name)
            if "memory" in args.parts:
                _memory_table(out, args, model, name)
        out.note(f"{time.perf_counter() - started:.0f} s in all")


def _program_name(model: str, args: argparse.Namespace) -> str:
    if model == "gpt2":
        return "GPT-2 4 x 256, 64 tokens, batch 8"
    return f"MLP {args.depth} x {args.width}, batch {args.batch}"


if __name__ == "__main__":
    main()
