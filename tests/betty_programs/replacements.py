"""A Betty program that changes itself half way, written in Betty 0.2.1's idiom
(``run(impl, ...)``: only the imports change between Betty and the drop-in).

The logistic-regression HPO of logreg_hpo.py with two lower problems on the same data (plain
SGD everywhere: Adam would hide a wrong hypergradient scale). For its first 20 iterations the
upper problem's hypergradient flows through ``inner1``; then a custom ``Engine.train_step``

* moves it to ``inner2`` with ``Engine.set_dependency``,
* gives ``inner1`` a new optimizer (``Problem.set_optimizer``, a smaller learning rate),
* gives ``inner2`` a fresh module and an optimizer over it (``set_module``, then
  ``set_optimizer``: Betty's optimizer keeps stepping the old parameters until then),
* and gives the upper problem a step-decay schedule (``set_scheduler``).

Both lower problems step every iteration; the upper steps every 5 of its lower's steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from betty_programs.logreg_hpo import ChildNet, ParentNet, data, make_data_loader
from betty_programs.ported import api, engine_config, learning_rates, snapshot

SWITCH = 20  # iterations before the change


def run(impl: str, strategy: str = "default", train_iters: int = 40) -> dict[str, Any]:
    """The final parameters, the step counts, the learning rates and the graph after the
    change."""
    b = api(impl)
    torch.manual_seed(0)
    d = data()
    active = {"lower": "inner1"}

    class Parent(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, targets = batch
            lower = getattr(self, active["lower"])
            return F.binary_cross_entropy_with_logits(lower(inputs)[0], targets)

        def configure_train_data_loader(self) -> list[tuple[torch.Tensor, ...]]:
            return make_data_loader(*d["val"])

        def configure_module(self) -> torch.nn.Module:
            return ParentNet()

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.module.parameters(), lr=1.0)

    class Child(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        lr = 0.1

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
            return torch.optim.SGD(self.module.parameters(), lr=self.lr)

    class SlowChild(Child):
        lr = 0.05

    class Switching(b.Engine):  # type: ignore[misc,name-defined]
        def train_step(self) -> None:
            if self.global_step == SWITCH + 1:
                outer, inner1, inner2 = self.outer, self.inner1, self.inner2
                self.set_dependency({"u2l": {outer: [inner2]}, "l2u": {inner2: [outer]}})
                active["lower"] = "inner2"
                inner1.set_optimizer(torch.optim.SGD(inner1.module.parameters(), lr=0.02))
                fresh = ChildNet()
                with torch.no_grad():
                    fresh.w.fill_(0.1)
                inner2.set_module(fresh)
                inner2.set_optimizer(torch.optim.SGD(inner2.module.parameters(), lr=0.05))
                outer.set_scheduler(torch.optim.lr_scheduler.StepLR(outer.optimizer, 2, 0.5))
            super().train_step()

    config = engine_config(b, impl, strategy, batchnorm=False, train_iters=train_iters,
                           logger_type="none")
    outer = Parent(name="outer", config=b.Config(first_order=True, retain_graph=True))
    inner1 = Child(name="inner1", config=b.Config(type="cg", cg_iterations=3, cg_alpha=1,
                                                  unroll_steps=5))
    inner2 = SlowChild(name="inner2", config=b.Config(type="cg", cg_iterations=3,
                                                      cg_alpha=1, unroll_steps=5))
    problems = [outer, inner1, inner2]
    engine = Switching(config=config, problems=problems,
                       dependencies={"l2u": {inner1: [outer]}, "u2l": {outer: [inner1]}})
    engine.run()
    return {"final": snapshot(problems), "counts": {p.name: p.count for p in problems},
            "learning_rates": learning_rates(problems),
            "graph": {p.name: ([q.name for q in p.parents], [q.name for q in p.children],
                               len(p.paths), p.leaf) for p in problems}}
