"""Second-order MAML at world 1: what metadist's strategies add over plain torch, per step.

    python -m benchmarks.maml_overhead [--sizes tiny,realistic] [--steps 40] [--warmup 3]
                                       [--device auto|cpu|cuda] [--json PATH] [--quick]

One meta-step: ``full_parameters()``, for each task 5 inner steps of ``functional_forward``
+ ``torch.autograd.grad(create_graph=True)`` and a query loss, one backward through all of
it, Adam. Plain torch runs the same loop on ``torch.func.functional_call``. At world 1 no
collective runs, so every difference is the host-side cost of the strategy's code (what a
fast GPU shows) and any host sync it adds. Sizes: *tiny* (MLP 1-40-40-1, 4 tasks: per-call
Python overhead dominates) and *realistic* (64-256-256-1, 8 tasks on the CPU; on a GPU the
64-1024-1024-1, 16 tasks of issue 29). The configurations take turns in one process (ms per
meta-step, medians), and each step's aten ops and host reads are counted once: the counts
do not depend on the machine's load, the times do.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import metadist
from benchmarks import device
from benchmarks.common import Results, alternate, output_args, parse
from benchmarks.meta import INNER_STEPS, maml_loss  # the meta benchmark's MAML step
from metadist.testing import count_ops

STRATEGIES = ("single", "ddp", "zero3")
#: size: (input, hidden, tasks); on a GPU the realistic size is issue 29's
SIZES = {"tiny": (1, 40, 4), "realistic": (64, 256, 8)}
GPU_SIZES = {"tiny": (1, 40, 4), "realistic": (64, 1024, 16)}


def mlp(inputs: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.Tanh(), nn.Linear(hidden, 1))


def tasks(inputs: int, count: int, where: torch.device) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(10, inputs if i % 2 == 0 else 1, generator=g).to(where)
                  for i in range(4)) for _ in range(count)]


def meta_steps(inputs: int, hidden: int, count: int,
               optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
               ) -> dict[str, Callable[[], Tensor]]:
    """One meta-step per configuration (plain torch and each strategy), on the same
    initial weights and tasks; each returns its loss. ``optimizer(params)``: Adam, lr 1e-3,
    unless given."""
    make = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
    here = metadist.world().device
    data = tasks(inputs, count, here)
    plain = mlp(inputs, hidden).to(here)
    plain_opt = make(plain.parameters())

    def plain_step() -> Tensor:
        plain_opt.zero_grad()
        loss = maml_loss(lambda p, x: torch.func.functional_call(plain, p, (x,)),
                         dict(plain.named_parameters()), data)
        loss.backward()
        plain_opt.step()
        return loss.detach()

    steps = {"plain torch": plain_step}
    for name in STRATEGIES:
        strategy = metadist.strategy(name)
        net = mlp(inputs, hidden)
        model, opt = strategy.setup(net, make(net.parameters()))

        def step(strategy: Any = strategy, model: Any = model, opt: Any = opt) -> Tensor:
            opt.zero_grad()
            loss = maml_loss(model.functional_forward, model.full_parameters(), data)
            strategy.backward(loss)
            opt.step()
            return loss.detach()

        steps[name] = step
    return steps


def counts(inputs: int, hidden: int, count: int) -> dict[str, dict[str, Any]]:
    """aten ops and host reads of one meta-step (the second: the first creates state)."""
    out = {}
    for name, step in meta_steps(inputs, hidden, count).items():
        step()
        with count_ops() as c:
            step()
        out[name] = {"ops": c.total, "host_reads": c.syncs,
                     "by_op": dict(c.ops)}
    return out


def _body(inputs: int, hidden: int, count: int, steps: int, warmup: int) -> dict[str, Any]:
    meta = meta_steps(inputs, hidden, count)
    losses: dict[str, list[float]] = {name: [] for name in meta}

    def run(name: str) -> Callable[[], None]:
        return lambda: losses[name].append(float(meta[name]()))

    ms = alternate({name: run(name) for name in meta}, steps, warmup)
    same = {name: max(abs(a - b) for a, b in zip(ls, losses["plain torch"], strict=True))
            for name, ls in losses.items()}
    return {"ms": {k: v * 1e3 for k, v in ms.items()}, "loss_diff": same,
            "counts": counts(inputs, hidden, count)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,realistic")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    device.add_args(ap, world=False)
    output_args(ap)
    args = parse(ap, sizes="tiny", steps=2, warmup=1)
    on = device.resolve(args)
    sizes = GPU_SIZES if on == "cuda" else SIZES
    with Results("maml_overhead", args) as results:
        for size in args.sizes.split(","):
            inputs, hidden, count = sizes[size]
            r = metadist.launch(_body, 1, args=(inputs, hidden, count, args.steps,
                                                args.warmup), threads=1, timeout=3000)[0]
            results.heading(f"second-order MAML, MLP {inputs}-{hidden}-{hidden}-1, {count} "
                            f"tasks x {INNER_STEPS} inner steps, world 1 "
                            f"({device.where(1)}): ms per meta-step, median of "
                            f"{args.steps}, taking turns")
            base = r["ms"]["plain torch"]
            plain = r["counts"]["plain torch"]
            rows = [[name, f"{ms:.2f}", f"{ms / base:.3f}", r["counts"][name]["ops"],
                     r["counts"][name]["host_reads"], f"{r['loss_diff'][name]:.1e}"]
                    for name, ms in r["ms"].items()]
            results.table(["configuration", "ms / step", "time ratio / plain torch",
                           f"aten ops / step (plain {plain['ops']})", "host syncs / step",
                           "max |loss - plain's|"], rows, key=size)
            results.data[size] = r


if __name__ == "__main__":
    main()
