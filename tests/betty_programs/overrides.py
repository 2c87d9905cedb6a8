"""A Betty program whose problems override Betty's overridable steps, written in Betty
0.2.1's idiom (``run(impl, ...)``: only the imports change between Betty and the drop-in).

The logistic-regression HPO of logreg_hpo.py, shrunk further (40 iterations, unroll 5: the
parent steps 8 times), with:

* the child's ``optimizer_step`` halving its gradient before Betty's update (a damped inner
  optimizer; plain SGD, so the halving is visible in the parameters);
* the parent's ``one_step_descent`` counting its calls and adding what it returns to a trace,
  then a plain SGD upper problem (no momentum: Adam would hide a wrong hypergradient scale).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from betty_programs.logreg_hpo import ChildNet, ParentNet, data, make_data_loader
from betty_programs.ported import api, engine_config, snapshot


def run(impl: str, strategy: str = "default", override: bool = True,
        train_iters: int = 40, valid_step: int = 0,
        validation: Any = None) -> dict[str, Any]:
    """The final parameters, the parent's descents and the step counts; ``validation``:
    what the engine's ``validation()`` returns (called with the engine) every
    ``valid_step`` iterations."""
    b = api(impl)
    descents: list[float] = []
    torch.manual_seed(0)
    d = data()

    class Parent(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, targets = batch
            return F.binary_cross_entropy_with_logits(self.inner(inputs)[0], targets)

        def configure_train_data_loader(self) -> list[tuple[torch.Tensor, ...]]:
            return make_data_loader(*d["val"])

        def configure_module(self) -> torch.nn.Module:
            return ParentNet()

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.module.parameters(), lr=1.0)

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

    class DampedChild(Child):
        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            for p in self.trainable_parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
            super().optimizer_step(*args, **kwargs)

    class CountingParent(Parent):
        def one_step_descent(self, batch: Any = None) -> Any:
            stats = super().one_step_descent(batch)
            descents.append(float(stats["loss"]))
            return stats

    fields = {"valid_step": valid_step} if valid_step else {}
    config = engine_config(b, impl, strategy, batchnorm=False, train_iters=train_iters,
                           logger_type="none", **fields)
    parent = (CountingParent if override else Parent)(
        name="outer", config=b.Config(first_order=True, retain_graph=True))
    child = (DampedChild if override else Child)(
        name="inner", config=b.Config(type="cg", cg_iterations=3, cg_alpha=1, unroll_steps=5))
    problems = [parent, child]
    engine_class = b.Engine
    if validation is not None:
        class Validating(b.Engine):  # type: ignore[misc,name-defined]
            def validation(self) -> Any:
                return validation(self)

        engine_class = Validating
    engine = engine_class(config=config, problems=problems,
                          dependencies={"l2u": {child: [parent]}, "u2l": {parent: [child]}})
    engine.run()
    global_steps = {p.name: p._global_step for p in problems}  # what Betty's examples read
    before = [(len(p.parents), len(p.children), len(p.paths)) for p in problems]
    for p in problems:
        p.clear_dependencies()
    after = [(len(p.parents), len(p.children), len(p.paths)) for p in problems]
    return {"final": snapshot(problems), "descents": descents,
            "counts": {p.name: p.count for p in problems}, "global_steps": global_steps,
            "dependencies": (before, after)}
