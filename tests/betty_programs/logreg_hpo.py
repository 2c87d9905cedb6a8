"""Betty 0.2.1's examples/logistic_regression_hpo/logistic_regression_implicit.py, ported to
run on Betty 0.2.1 and on metadist.compat.betty with only the imports changed
(``run(impl, ...)``).

What is the original's, kept: a logistic regression (``ChildNet``: weights ``w`` from zeros,
forward returning the logits *and* ``w``) whose training loss carries an L2 penalty
``0.5 * w^T diag(self.outer()) w`` with per-feature strengths ``ParentNet.w`` (from ones);
``Parent`` scores the child on validation data and clamps its parameters to >= 1e-8 in
``param_callback`` (``p.data.clamp_``); ``Child`` zeroes ``self.module.w.data`` in
``on_inner_loop_start`` (every inner loop restarts from zero); the child's Config
``type="cg", cg_iterations=3, cg_alpha=1``; the parent's ``log_step=1, first_order=True,
retain_graph=True``; SGD(lr=1, momentum=0.9) for the parent, SGD(lr=0.1) for the child;
modules, optimizers and data through the ``configure_*`` hooks; each problem's data is a
plain list holding one batch (``make_data_loader``); problem names "outer"/"inner".

Shrunk: 200 samples of 20 features (not 1000) split in halves, 5 unroll steps (not 100) and
80 iterations (the parent steps 16 times; from its 13th step on, param_callback raises
entries to the 1e-8 floor: ``clamped`` counts them), in float64 (the original casts to float32); the
data come from a private torch generator (the original draws from numpy's global generator
and splits with scikit-learn). On N ranks each rank's list holds its 1/N of the rows (a plain
list is not a DataLoader: no framework can split it), so N ranks see one process's batch.
Betty 0.2.1 ran it with no other change.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from betty_programs.ported import api, engine_config, learning_rates, place, snapshot

DATA_NUM, DATA_DIM = 200, 20


def data() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w_gt = torch.randn(DATA_DIM, generator=g, dtype=torch.float64)
    x = torch.randn(DATA_NUM, DATA_DIM, generator=g, dtype=torch.float64)
    y = ((x @ w_gt + 0.1 * torch.randn(DATA_NUM, generator=g, dtype=torch.float64)) > 0)
    order = torch.randperm(DATA_NUM, generator=g)
    train, val = order[:DATA_NUM // 2], order[DATA_NUM // 2:]
    return {"train": (x[train], y[train].double()), "val": (x[val], y[val].double())}


def make_data_loader(xs: torch.Tensor, ys: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    world, rank = place()
    share = len(ys) // world
    rows = slice(rank * share, (rank + 1) * share)
    return [(xs[rows], ys[rows])]


class ChildNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(DATA_DIM, dtype=torch.float64))

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs @ self.w, self.w


class ParentNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(DATA_DIM, dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        return self.w


# The child's Config per hypergradient method: the original's cg, and the other methods its
# README reports reaching the same result (their iteration counts and step sizes as cg's).
METHODS: dict[str, dict[str, Any]] = {
    "cg": {"type": "cg", "cg_iterations": 3, "cg_alpha": 1},
    "neumann": {"type": "neumann", "neumann_iterations": 3, "neumann_alpha": 1},
    "darts": {"type": "darts"},
    "sama": {"type": "sama"},
}


def run(impl: str, strategy: str = "default", train_iters: int = 80,
        unroll_steps: int = 5, method: str = "cg", momentum: float = 0.9) -> dict[str, Any]:
    """Tune for ``train_iters`` iterations; both problems' initial and final parameters, the
    parent's logged losses (rank 0), and what its param_callback saw. ``method``: the
    child's hypergradient (:data:`METHODS`); ``momentum=0`` puts the parent on plain SGD,
    where a wrong hypergradient scale shows in its parameters (momentum 0.9 only smooths it,
    Adam would normalise it away)."""
    b = api(impl)
    losses: list[tuple[str, int, float]] = []
    clamped: list[int] = []  # how many entries each param_callback raised to the floor
    torch.manual_seed(0)
    d = data()

    class Parent(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, targets = batch
            outs = self.inner(inputs)[0]
            return F.binary_cross_entropy_with_logits(outs, targets)

        def configure_train_data_loader(self) -> list[tuple[torch.Tensor, ...]]:
            return make_data_loader(*d["val"])

        def configure_module(self) -> torch.nn.Module:
            return ParentNet()

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.module.parameters(), lr=1, momentum=momentum)

        def param_callback(self) -> None:
            for p in self.trainable_parameters():
                clamped.append(int((p.data < 1e-8).sum()))
                p.data.clamp_(min=1e-8)

        def log(self, stats: dict[str, Any], global_step: Any) -> None:
            losses.append((self.name, self.count, float(stats["loss"])))

    class Child(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, targets = batch
            outs, params = self.module(inputs)
            penalty = params.unsqueeze(0) @ torch.diag(self.outer()) @ params.unsqueeze(1)
            return F.binary_cross_entropy_with_logits(outs, targets) + 0.5 * penalty.sum()

        def configure_train_data_loader(self) -> list[tuple[torch.Tensor, ...]]:
            return make_data_loader(*d["train"])

        def configure_module(self) -> torch.nn.Module:
            return ChildNet()

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.module.parameters(), lr=0.1)

        def on_inner_loop_start(self) -> None:
            self.module.w.data.zero_()

    config = engine_config(b, impl, strategy, batchnorm=False, train_iters=train_iters,
                           logger_type="none")
    parent_config = b.Config(log_step=1, first_order=True, retain_graph=True)
    child_config = b.Config(**METHODS[method], unroll_steps=unroll_steps)
    parent = Parent(name="outer", config=parent_config)
    child = Child(name="inner", config=child_config)
    problems = [parent, child]
    engine = b.Engine(config=config, problems=problems,
                      dependencies={"l2u": {child: [parent]}, "u2l": {parent: [child]}})
    initial = snapshot(problems)
    engine.run()
    return {"initial": initial, "final": snapshot(problems), "losses": losses,
            "clamped": clamped, "lr": learning_rates(problems),
            "counts": {p.name: p.count for p in problems}}
