"""A two-level program in Betty's style whose problems reach their modules as containers:
``self.module[0]``, ``len(self.module)``, ``for layer in self.module`` (Betty's "default"
strategy hands a problem the user's own ``nn.Sequential``). Runnable on Betty 0.2.1 and on
metadist.compat.betty; tests/test_betty_compat.py runs both."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from betty_programs.ported import api, place

STEPS, WIDTH = 6, 4


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    world, rank = place()
    out = []
    for _ in range(STEPS + 2):
        x = torch.randn(8, WIDTH, generator=g, dtype=torch.float64)
        y = torch.sin(x.sum(1, keepdim=True))
        share = 8 // world
        out.append((x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
    return out


def run(impl: str, strategy: str = "default") -> dict[str, Any]:
    b = api(impl)

    class Inner(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            assert len(self.module) == 3
            h = x
            for layer in self.module:  # iteration
                h = layer(h)
            decay = self.outer.module[0].exp()  # indexing another problem's container
            return ((h - y) ** 2).mean() + decay * (self.module[0].weight ** 2).sum()

    class Outer(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return ((self.inner(x) - y) ** 2).mean()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)).double()
    log_decay = nn.ParameterList([nn.Parameter(torch.tensor(-2.0, dtype=torch.float64))])
    data = _batches()
    inner = Inner("inner", b.Config(type="darts", unroll_steps=1), net,
                  torch.optim.SGD(net.parameters(), lr=0.1), None, data)
    outer = Outer("outer", b.Config(type="darts"), log_decay,
                  torch.optim.SGD(log_decay.parameters(), lr=0.1), None, data)
    b.Engine([outer, inner], b.EngineConfig(train_iters=STEPS, strategy=strategy),
             {"u2l": {outer: [inner]}, "l2u": {inner: [outer]}}).run()
    # state_dict(): the portable read (under "fsdp" the modules hold shards between forwards)
    return {**{f"inner.{k}": v.clone() for k, v in net.state_dict().items()},
            **{f"outer.{k}": v.clone() for k, v in log_decay.state_dict().items()}}
