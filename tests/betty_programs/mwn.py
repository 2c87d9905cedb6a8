"""A Meta-Weight-Net program in Betty's style, runnable on Betty 0.2.1 itself and on
metadist.compat.betty, so that the two can be compared case by case.

``run(impl, case)`` with ``impl`` "betty" (Betty must be importable) or "compat"; ``CASES``
names the variants (hypergradient types and Betty's schedule options).
tests/test_betty_compat.py runs both (Betty from .peers/).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# name -> (inner Config kwargs, engine kwargs, options)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "darts": ({"type": "darts"}, {}, {}),
    "neumann": ({"type": "neumann", "neumann_iterations": 3, "neumann_alpha": 0.1}, {}, {}),
    "cg": ({"type": "cg", "cg_iterations": 3, "cg_alpha": 0.1}, {}, {}),
    "sama_adam": ({"type": "sama"}, {}, {"inner_adam": True}),
    "warmup": ({"type": "darts", "warmup_steps": 3}, {}, {}),
    "roll_back": ({"type": "darts"}, {"roll_back": True}, {}),
    "accumulation": ({"type": "darts", "gradient_accumulation": 2}, {}, {}),
    "custom_step": ({"type": "darts"}, {}, {"custom": True}),
    "epochs": ({"type": "darts"}, {"train_iters": 40}, {}),
}


def _modules(impl: str) -> tuple[Any, Any, Any]:
    root = "betty" if impl == "betty" else "metadist.compat.betty"
    return (importlib.import_module(f"{root}.engine"), importlib.import_module(f"{root}.configs"),
            importlib.import_module(f"{root}.problems"))


def run(impl: str, case: str, strategy: str = "default") -> dict[str, Any]:
    """Train ``case`` for its iterations; on N ranks each reads 1/N of the global batches."""
    engine_mod, configs, problems = _modules(impl)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    inner_kw, engine_kw, options = CASES[case]
    calls: list[tuple[str, int]] = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g, dtype=torch.float64)
    y = (x[:, :3].argmax(1) + (torch.rand(256, generator=g) < 0.3).long()) % 3
    xm = torch.randn(64, 8, generator=g, dtype=torch.float64)

    class Outer(problems.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            a, b = batch
            return F.cross_entropy(self.inner(a), b)

        if options.get("custom"):
            def custom_optimizer_step(self) -> None:
                calls.append(("custom", self.count))
                for p in self.trainable_parameters():
                    p.data.add_(p.grad, alpha=-0.05)

    class Inner(problems.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            a, b = batch
            losses = F.cross_entropy(self.module(a), b, reduction="none")
            return (self.outer(losses.detach().unsqueeze(1)).squeeze(1) * losses).mean()

        def on_inner_loop_start(self) -> None:
            calls.append(("start", self.count))

        def param_callback(self) -> None:
            calls.append(("param", self.count))

        def epoch_callback(self) -> None:
            calls.append(("epoch", self.count))

    torch.manual_seed(1)
    clf = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    wnet = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid()).double()
    inner_opt = (torch.optim.Adam(clf.parameters(), lr=0.01) if options.get("inner_adam")
                 else torch.optim.SGD(clf.parameters(), lr=0.1, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(inner_opt, step_size=3, gamma=0.5)
    inner = Inner(name="inner", module=clf, optimizer=inner_opt, scheduler=scheduler,
                  train_data_loader=DataLoader(TensorDataset(x, y), batch_size=32 // world),
                  config=configs.Config(unroll_steps=2, **inner_kw))
    outer = Outer(name="outer", module=wnet, optimizer=torch.optim.Adam(wnet.parameters(),
                                                                        lr=0.01),
                  train_data_loader=DataLoader(TensorDataset(xm, xm[:, :3].argmax(1)),
                                               batch_size=16 // world),
                  config=configs.Config(retain_graph=True))
    config = configs.EngineConfig(**{"train_iters": 12, "valid_step": 10**9,
                                     "strategy": strategy, **engine_kw})
    engine = engine_mod.Engine(config=config, problems=[outer, inner],
                               dependencies={"u2l": {outer: [inner]}, "l2u": {inner: [outer]}})
    engine.run()
    out: dict[str, Any] = {f"{p.name}.{k}": v.detach().clone() for p in (inner, outer)
                           for k, v in p.module.state_dict().items()}
    out.update(calls=calls, counts=(inner.count, outer.count),
               lr=inner.optimizer.param_groups[0]["lr"])
    return out
