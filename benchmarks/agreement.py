"""What the ranks' agreement at every step costs (strategies/agreement.py).

    python -m benchmarks.agreement [--world 2] [--steps 20] [--warmup 3]
                                   [--workloads mlp,small] [--json PATH] [--quick]

At every ``optimizer.step()`` the param groups' hyperparameters (hashed) and the backward
passes and world collectives since the previous step are compared across ranks in one
all-gather of three integers a rank, on a gloo group of its own. Each strategy trains two
copies of the model in the same processes, taking turns step by step (medians, warm-up
discarded): as shipped, and with the step's agreement left out. ``mlp`` is the ddp/zero
benchmarks' 25M-parameter MLP (Adam, batch 32 per rank); ``small`` a 2-layer MLP of width
256, where a step is short and any fixed cost shows most.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import metadist
from benchmarks.common import Results, alternate, output_args, parse
from benchmarks.models import workload, zero3_unit_params
from metadist.strategies import step_chain

STRATEGIES = ("ddp", "zero2", "zero3")


def _steps(name: str, quick: bool) -> dict[str, Callable[[], None]]:
    factory, data, loss_fn = workload("mlp", quick or name == "small")
    batches = data(metadist.world().rank)
    out: dict[str, Callable[[], None]] = {}
    for strategy in STRATEGIES:
        for agreeing in (True, False):
            model = factory()
            options: dict[str, Any] = ({"min_unit_params": zero3_unit_params(
                quick or name == "small")} if strategy == "zero3" else {})
            s = metadist.strategy(strategy, **options)
            wrapped, opt = s.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
            if not agreeing:
                chain = step_chain.chain_of(opt)
                assert chain is not None
                chain._steps.pop("agree", None)
            at = [0]

            def step(s: Any = s, wrapped: nn.Module = wrapped, opt: Any = opt,
                     at: list[int] = at) -> None:
                x, y = batches[at[0] % len(batches)]
                at[0] += 1
                opt.zero_grad()
                s.backward(loss_fn(wrapped(x), y))
                opt.step()

            out[f"{strategy}{'' if agreeing else ', agreement left out'}"] = step
    return out


def _body(name: str, steps: int, warmup: int, quick: bool) -> dict[str, float]:
    ms = alternate(_steps(name, quick), steps, warmup)
    return {k: v * 1e3 for k, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--workloads", default="mlp,small")
    output_args(ap)
    args = parse(ap, steps=2, warmup=1, workloads="small")
    with Results("agreement", args) as results:
        for name in args.workloads.split(","):
            ms = metadist.launch(_body, args.world, args=(name, args.steps, args.warmup,
                                                          args.quick), threads=1,
                                 timeout=3000)[0]
            results.heading(f"{name} MLP, {args.world} ranks (gloo, a thread each): ms per "
                            f"step, medians of {args.steps}, taking turns")
            rows = [[s, f"{ms[s]:.2f}", f"{ms[s + ', agreement left out']:.2f}",
                     f"{ms[s] / ms[s + ', agreement left out']:.3f}"] for s in STRATEGIES]
            results.table(["strategy", "ms / step", "without the agreement",
                           "ratio"], rows, key=name)
            results.data[name] = ms


if __name__ == "__main__":
    main()
