"""A Betty-style program, written as Betty's users write them (configure_* hooks, get_batch,
callbacks, an Env, three levels); only the imports name metadist.compat.betty.

``python -m metadist run --nproc N tests/betty_programs/reweight.py OUT STRATEGY TYPE`` saves
the final parameters and the callback trace to OUT (rank 0).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from metadist.compat.betty.configs import Config, EngineConfig
from metadist.compat.betty.engine import Engine
from metadist.compat.betty.envs import Env
from metadist.compat.betty.problems import ImplicitProblem

GLOBAL_BATCH, META_BATCH = 24, 12


def data(world: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 6, generator=g, dtype=torch.float64)
    noisy = (x[:, :3].argmax(1) + (torch.rand(192, generator=g) < 0.3).long()) % 3
    xm = torch.randn(48, 6, generator=g, dtype=torch.float64)
    # Betty's batch_size is per rank: N ranks read what one process reads with N x it
    return (DataLoader(TensorDataset(x, noisy), batch_size=GLOBAL_BATCH // world),
            DataLoader(TensorDataset(xm, xm[:, :3].argmax(1)), batch_size=META_BATCH // world))


def _one(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, 1, dtype=x.dtype, device=x.device)


class Trace(Env):
    """Counts what the callbacks saw (every problem reaches it as self.env)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []


class Classifier(ImplicitProblem):
    def configure_module(self) -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=0.9)

    def configure_scheduler(self) -> Any:
        return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=4, gamma=0.5)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        losses = F.cross_entropy(self.module(x), y, reduction="none")
        weights = self.reweight(losses.detach().unsqueeze(1)).squeeze(1)
        return (weights * losses).mean()

    def on_inner_loop_start(self) -> None:
        self.env.calls.append(("start", self.count))

    def param_callback(self) -> None:
        self.env.calls.append(("param", self.count))


class Reweight(ImplicitProblem):
    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.classifier(x), y)
        if hasattr(self, "temperature"):  # the three-level variant
            loss = loss + 0.01 * self.temperature(_one(x)).sum()
        return loss

    def grad_callback(self) -> None:
        self.env.calls.append(("grad", self.count))


class Temperature(ImplicitProblem):
    """A third level: a scale on the meta loss's weights network, tuned on the meta data."""

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.classifier(x) * self.module(_one(x)).sum(), y)

    def get_batch(self) -> Any:
        return self.reweight.cur_batch  # the level below's batch


def run(out: str | None, strategy: str, kind: str, levels: int = 2, iters: int = 12
        ) -> dict[str, Any]:
    import metadist

    world = metadist.init().world_size
    train, meta = data(world)
    torch.manual_seed(2)
    wnet = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid()).double()
    classifier = Classifier("classifier", Config(type=kind, unroll_steps=2),
                            train_data_loader=train)
    reweight = Reweight("reweight", Config(type="darts", log_step=0), wnet,
                        torch.optim.Adam(wnet.parameters(), lr=0.01), None, meta)
    problems: list[ImplicitProblem] = [reweight, classifier]
    u2l: dict[Any, list[Any]] = {reweight: [classifier]}
    l2u: dict[Any, list[Any]] = {classifier: [reweight]}
    if levels == 3:
        scale = nn.Linear(1, 1, bias=False).double()
        nn.init.ones_(scale.weight)
        temperature = Temperature("temperature", Config(), scale,
                                  torch.optim.SGD(scale.parameters(), lr=0.05))
        problems.append(temperature)
        l2u = {classifier: [reweight], reweight: [temperature]}
        u2l = {reweight: [classifier], temperature: [reweight]}
    env = Trace()
    engine = Engine(problems, EngineConfig(train_iters=iters, valid_step=0, strategy=strategy),
                    {"u2l": u2l, "l2u": l2u}, env)
    engine.run()
    result = {f"{p.name}.{k}": v.detach().clone() for p in problems
              for k, v in p.module.state_dict().items()}
    result["calls"] = env.calls
    result["lr"] = classifier.optimizer.param_groups[0]["lr"]
    if out is not None and metadist.world().rank == 0:
        torch.save(result, out)
    return result


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2)
