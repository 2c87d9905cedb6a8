"""An implicit-MAML program in Betty's style (an Env that samples tasks, a custom
Engine.train_step calling leaf.step, get_batch from the Env, a proximal term on
self.parameters() and self.outer.parameters(), on_inner_loop_start loading the meta
weights, gradient accumulation over tasks, a dict loss with metrics), runnable on Betty
0.2.1 and on metadist.compat.betty. tests/test_betty_compat.py runs both
(Betty from .peers/).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WAYS, SHOTS, INNER_STEPS, TASKS = 3, 4, 3, 2


def _task(g: torch.Generator, world: int, rank: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """A few-shot task: WAYS Gaussian classes; support and query sets (each rank its rows)."""
    centers = torch.randn(WAYS, 5, generator=g, dtype=torch.float64) * 2
    labels = torch.arange(WAYS).repeat_interleave(2 * SHOTS)
    x = centers[labels] + torch.randn(len(labels), 5, generator=g, dtype=torch.float64)
    support, query = torch.arange(len(labels)) % 2 == 0, torch.arange(len(labels)) % 2 == 1
    out = {}
    for name, mask in (("train", support), ("test", query)):
        xs, ys = x[mask], labels[mask]
        share = len(ys) // world
        out[name] = (xs[rank * share:(rank + 1) * share], ys[rank * share:(rank + 1) * share])
    return out


def run(impl: str, strategy: str = "default", iters: int = 24) -> dict[str, Any]:
    root = "betty" if impl == "betty" else "metadist.compat.betty"
    engine_mod = importlib.import_module(f"{root}.engine")
    configs = importlib.import_module(f"{root}.configs")
    problems = importlib.import_module(f"{root}.problems")
    envs = importlib.import_module(f"{root}.envs")
    dist = torch.distributed
    world, rank = ((dist.get_world_size(), dist.get_rank()) if dist.is_initialized()
                   else (1, 0))

    class TaskEnv(envs.Env):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.g = torch.Generator().manual_seed(0)
            self.batch: dict[str, Any] = {}

        def step(self) -> None:
            self.batch = _task(self.g, world, rank)

    class Outer(problems.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> dict[str, Any]:
            x, y = batch
            out = self.inner(x)
            return {"loss": F.cross_entropy(out, y),
                    "acc": float((out.argmax(1) == y).double().mean())}

        def get_batch(self) -> Any:
            return self.env.batch["test"]

    class Inner(problems.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            prox = sum(((a - b) ** 2).sum() for a, b in zip(self.parameters(),
                                                             self.outer.parameters(),
                                                             strict=True))
            return F.cross_entropy(self.module(x), y) + 0.25 * prox

        def get_batch(self) -> Any:
            return self.env.batch["train"]

        def on_inner_loop_start(self) -> None:
            self.module.load_state_dict(self.outer.module.state_dict())

    class TaskEngine(engine_mod.Engine):  # type: ignore[misc,name-defined]
        def train_step(self) -> None:
            if self.global_step % INNER_STEPS == 1:
                self.env.step()
            for leaf in self.leaves:
                leaf.step(global_step=self.global_step)

    torch.manual_seed(3)
    meta = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, WAYS)).double()
    fast = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, WAYS)).double()
    meta_opt = torch.optim.Adam(meta.parameters(), lr=0.01)  # Betty 0.2.1 cannot rebuild AdamW
    outer = Outer(name="outer", module=meta, optimizer=meta_opt,
                  scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(meta_opt, T_max=50),
                  config=configs.Config(retain_graph=True, gradient_accumulation=TASKS))
    inner = Inner(name="inner", module=fast,
                  optimizer=torch.optim.SGD(fast.parameters(), lr=0.1),
                  config=configs.Config(type="cg", cg_iterations=3, cg_alpha=1.0,
                                        unroll_steps=INNER_STEPS))
    engine = TaskEngine(config=configs.EngineConfig(train_iters=iters, valid_step=10**9,
                                                    strategy=strategy),
                        problems=[outer, inner],
                        dependencies={"u2l": {outer: [inner]}, "l2u": {inner: [outer]}},
                        env=TaskEnv())
    engine.run()
    out: dict[str, Any] = {f"{p.name}.{k}": v.detach().clone() for p in (outer, inner)
                           for k, v in p.module.state_dict().items()}
    out["counts"] = (inner.count, outer.count)
    return out
