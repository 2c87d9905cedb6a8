"""Second-order MAML on sinusoid regression, run by metadist's Engine.

    metadist run --nproc 2 examples/maml_engine.py [--strategy ddp|zero1|zero2|zero3]

One problem, the meta-learner: its ``training_step`` adapts to each task of its share of the
meta-batch with ``create_graph=True`` steps on fast weights (``self.parameters_dict()`` and
``self.functional_forward``, which work under every strategy, zero3 included), and returns the
mean query loss. The engine's loader splits each meta-batch of tasks across ranks; the meta-
gradient is averaged once, so training equals single-process MAML on the whole meta-batch.
Validation (rank 0) adapts to held-out tasks and reports the query MSE.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import metadist
from metadist.meta import Engine, EngineConfig, Problem

Params = dict[str, Tensor]


class Sinusoids(Dataset[tuple[Tensor, ...]]):
    """Task ``i``: y = a sin(x + b) with a in [0.1, 5], b in [0, pi]; ``k`` support and ``k``
    query points in [-5, 5]. Deterministic per index, so every rank agrees on every task."""

    def __init__(self, count: int, k: int = 10, seed: int = 0) -> None:
        self.count, self.k, self.seed = count, k, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        amp, phase = 0.1 + 4.9 * torch.rand(1, generator=g), math.pi * torch.rand(1, generator=g)
        x = torch.rand(2 * self.k, 1, generator=g) * 10 - 5
        y = amp * torch.sin(x + phase)
        return x[:self.k], y[:self.k], x[self.k:], y[self.k:]


def adapt(forward: Callable[[Params, Tensor], Tensor], params: Params, x: Tensor, y: Tensor,
          steps: int, lr: float, create_graph: bool) -> Params:
    """``steps`` SGD steps on the support set; differentiable with ``create_graph``."""
    for _ in range(steps):
        loss = nn.functional.mse_loss(forward(params, x), y)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
        params = {n: p - lr * g for (n, p), g in zip(params.items(), grads, strict=True)}
    return params


class MetaLearner(Problem):
    def __init__(self, *args: Any, inner_steps: int, inner_lr: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inner_steps, self.inner_lr = inner_steps, inner_lr

    def training_step(self, batch: Any) -> Tensor:
        xs, ys, xq, yq = batch  # [tasks, k, 1] each: this rank's share of the meta-batch
        losses = []
        for t in range(xs.shape[0]):
            fast = adapt(self.functional_forward, self.parameters_dict(), xs[t], ys[t],
                         self.inner_steps, self.inner_lr, create_graph=True)
            losses.append(nn.functional.mse_loss(self.functional_forward(fast, xq[t]), yq[t]))
        return torch.stack(losses).mean()


class MAMLEngine(Engine):
    """Validation on rank 0: query MSE after adapting to held-out tasks."""

    def __init__(self, *args: Any, tests: Sinusoids, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tests = tests
        self.curve: list[tuple[int, float]] = []
        self.fit: tuple[Tensor, ...] | None = None

    def evaluate(self, steps: int | None = None) -> float:
        learner = self.problems["maml"]
        assert isinstance(learner, MetaLearner)
        total = 0.0
        for i in range(len(self.tests)):
            xs, ys, xq, yq = (t.to(self.world.device) for t in self.tests[i])
            fast = adapt(learner.functional_forward, learner.parameters_dict(), xs, ys,
                         learner.inner_steps if steps is None else steps, learner.inner_lr,
                         create_graph=False)
            with torch.no_grad():
                total += nn.functional.mse_loss(learner.functional_forward(fast, xq), yq).item()
        return total / len(self.tests)

    def validation(self) -> dict[str, float]:
        mse = self.evaluate()
        self.curve.append((self.global_step, mse))
        # One held-out task on a grid, before and after adaptation, for the plot.
        learner = self.problems["maml"]
        assert isinstance(learner, MetaLearner)
        xs, ys, _, _ = (t.to(self.world.device) for t in self.tests[0])
        grid = torch.linspace(-5, 5, 200, device=self.world.device).unsqueeze(1)
        start = learner.parameters_dict()
        fast = adapt(learner.functional_forward, start, xs, ys, learner.inner_steps,
                     learner.inner_lr, create_graph=False)
        with torch.no_grad():
            self.fit = tuple(t.cpu() for t in (grid, learner.functional_forward(start, grid),
                                               learner.functional_forward(fast, grid), xs, ys))
        return {"meta_test_mse": mse}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--meta-batch", type=int, default=8, help="tasks per step, all ranks")
    ap.add_argument("--inner-steps", type=int, default=3)
    ap.add_argument("--inner-lr", type=float, default=0.02)
    ap.add_argument("--lr", type=float, default=3e-3, help="meta learning rate (Adam)")
    ap.add_argument("--valid-step", type=int, default=50)
    ap.add_argument("--plot", default="out/maml_engine.png", help="PNG ('' to skip)")
    args = ap.parse_args(argv)

    start = time.perf_counter()
    world = metadist.init()
    if args.meta_batch % world.world_size:
        raise SystemExit(f"--meta-batch {args.meta_batch} must divide by {world.world_size} "
                         "ranks")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                        nn.Linear(40, 1))
    tasks = DataLoader(Sinusoids(args.iters * args.meta_batch),
                       batch_size=args.meta_batch // world.world_size)
    learner = MetaLearner("maml", net, torch.optim.Adam(net.parameters(), lr=args.lr),
                          train_data_loader=tasks, inner_steps=args.inner_steps,
                          inner_lr=args.inner_lr)
    engine = MAMLEngine([learner], EngineConfig(strategy=args.strategy, train_iters=args.iters,
                                                valid_step=args.valid_step),
                        tests=Sinusoids(20, seed=1))
    # Before training (every rank runs the same validation round: collective state sync).
    engine.validate()
    before = engine.last_validation["meta_test_mse"]
    engine.run()
    after = engine.last_validation["meta_test_mse"]
    metadist.print(f"{args.strategy} on {world.world_size} rank(s): meta-test MSE after "
                   f"{args.inner_steps} adaptation steps {after:.3f} (before meta-training "
                   f"{before:.3f}; {time.perf_counter() - start:.1f}s)")
    if args.plot and world.rank == 0:
        _plot(args, engine)
        metadist.print(f"plot written to {args.plot}")
    return {"before": before, "after": after}


def _plot(args: argparse.Namespace, engine: MAMLEngine) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    fig, (ax, fit) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax.plot(*zip(*engine.curve, strict=True), marker="o")
    ax.set_xlabel("meta-iteration")
    ax.set_ylabel(f"query MSE after {args.inner_steps} steps")
    ax.set_yscale("log")
    ax.set_title("held-out tasks")
    if engine.fit is not None:
        grid, before, after, xs, ys = engine.fit
        fit.plot(grid, before, "--", label="meta-learned init")
        fit.plot(grid, after, label=f"after {args.inner_steps} steps")
        fit.scatter(xs, ys, color="k", s=12, label="support points", zorder=3)
        fit.legend(fontsize=8)
        fit.set_title("one held-out task")
    fig.suptitle("second-order MAML on sinusoids (metadist Engine)")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
    metadist.shutdown()
