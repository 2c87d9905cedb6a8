"""BatchNorm in meta-learning at 2 ranks: what combining the running statistics costs.

    python -m benchmarks.task_batchnorm [--steps 20] [--warmup 2] [--json PATH] [--quick]

One meta-step of second-order MAML under ddp on a convolutional net with a BatchNorm after
each convolution (OmniglotCNN's blocks, 1 x 28 x 28 inputs, 5-way tasks), each rank on its
own tasks through ``full_parameters()`` + ``functional_forward``. Each task's forwards record
the update they would make to the running statistics; the optimizer's step combines every
rank's records in rank order (strategies/batchnorm/running_stats.py: one small all-reduce, then one
all-gather of the records). The configurations take turns in one launch (ms per meta-step,
medians):

* *combined*: as shipped;
* *not combined*: the same records, the step's combination left out (what it costs);
* *no running statistics*: ``track_running_stats=False`` (nothing recorded nor combined).

And a data-parallel step (``sync_batchnorm=False``, each rank's slice a batch of its own)
with and without the combination.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import metadist
from benchmarks.common import Results, alternate, output_args, parse

WAYS, SHOTS, QUERIES, INNER_LR = 5, 5, 5, 0.1


def convnet(channels: int, track: bool) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for c_in in (1, channels, channels):
        blocks += [nn.Conv2d(c_in, channels, 3, stride=2, padding=1),
                   nn.BatchNorm2d(channels, track_running_stats=track), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(channels * 4 * 4, WAYS))


def tasks(count: int) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        y = torch.arange(WAYS).repeat_interleave(SHOTS)
        out.append((torch.randn(len(y), 1, 28, 28, generator=g), y,
                    torch.randn(len(y), 1, 28, 28, generator=g), y))
    return out


def maml_loss(model: Any, data: list[tuple[Tensor, ...]]) -> Tensor:
    params = model.full_parameters()
    total = torch.zeros(())
    for xs, ys, xq, yq in data:
        grads = torch.autograd.grad(F.cross_entropy(model.functional_forward(params, xs), ys),
                                    list(params.values()), create_graph=True)
        fast = {n: p - INNER_LR * g for (n, p), g in zip(params.items(), grads, strict=True)}
        total = total + F.cross_entropy(model.functional_forward(fast, xq), yq)
    return total / len(data)


def _setup(track: bool, channels: int, said: bool | None) -> tuple[Any, Any, Any]:
    net = convnet(channels, track)
    s = metadist.strategy("ddp", sync_batchnorm=said)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    return s, model, opt


def _uncombined(model: Any) -> None:
    """The step's combination left out (the records are still made)."""
    ledger = model.running_stats() if hasattr(type(model), "running_stats") else None
    if ledger is not None:
        ledger.sync = lambda: None


def steps(channels: int, per_rank: int) -> dict[str, Callable[[], None]]:
    data = tasks(per_rank)
    out: dict[str, Callable[[], None]] = {}
    for name, track, combine in (("MAML, combined", True, True),
                                 ("MAML, not combined", True, False),
                                 ("MAML, no running statistics", False, True)):
        s, model, opt = _setup(track, channels, None)
        if not combine:
            _uncombined(model)

        def meta(s: Any = s, model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad()
            s.backward(maml_loss(model, data))
            opt.step()

        out[name] = meta
    x, y = data[0][0], data[0][1]
    for name, combine in (("data parallel, combined", True),
                          ("data parallel, not combined", False)):
        s, model, opt = _setup(True, channels, False)
        if not combine:
            _uncombined(model)

        def step(s: Any = s, model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad()
            s.backward(F.cross_entropy(model(x), y))
            opt.step()

        out[name] = step
    return out


def _body(channels: int, per_rank: int, reps: int, warmup: int) -> dict[str, float]:
    ms = alternate(steps(channels, per_rank), reps, warmup)
    return {name: seconds * 1e3 for name, seconds in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--tasks", type=int, default=4, help="tasks per rank")
    output_args(ap)
    args = parse(ap, steps=2, warmup=1, channels=4, tasks=1)
    with Results("task_batchnorm", args) as results:
        ms = metadist.launch(_body, 2, args=(args.channels, args.tasks, args.steps,
                                             args.warmup), threads=1, timeout=3000)[0]
        results.heading(f"ddp, 2 ranks (gloo, a thread each): conv net with {args.channels} "
                        f"channels and BatchNorm, {args.tasks} tasks per rank; ms per step, "
                        f"median of {args.steps}, taking turns")
        rows = []
        for kind in ("MAML", "data parallel"):
            base = ms[f"{kind}, not combined"]
            rows += [[name, f"{value:.2f}", f"{value / base:.3f}"]
                     for name, value in ms.items() if name.startswith(kind)]
        results.table(["configuration", "ms / step", "ratio / not combined"], rows,
                      key="steps")
        results.data["ms"] = ms


if __name__ == "__main__":
    main()
