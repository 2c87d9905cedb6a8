"""What the ports of Betty 0.2.1's example programs (nas.py, lbi.py, logreg_hpo.py,
bert_reweight.py, pruning.py, sanas.py, tutorials.py) share: the implementation's classes,
this process's place in the world, the EngineConfig of a run, snapshots of every problem's
state, and the reweighting examples' meta-network layer.

A port names Betty's classes through :func:`api` only, so the program text is the same for
``impl="betty"`` (Betty 0.2.1 itself, importable as ``betty``) and ``impl="compat"``
(``metadist.compat.betty``): only the imports change.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


def api(impl: str) -> SimpleNamespace:
    """Engine, Config, EngineConfig and ImplicitProblem of Betty or of the compat layer."""
    if impl not in ("betty", "compat"):
        raise ValueError(f"impl is 'betty' or 'compat', not {impl!r}")
    root = "betty" if impl == "betty" else "metadist.compat.betty"
    engine = importlib.import_module(f"{root}.engine")
    configs = importlib.import_module(f"{root}.configs")
    problems = importlib.import_module(f"{root}.problems")
    return SimpleNamespace(Engine=engine.Engine, Config=configs.Config,
                           EngineConfig=configs.EngineConfig,
                           ImplicitProblem=problems.ImplicitProblem)


def place() -> tuple[int, int]:
    """(world size, rank) of this process; (1, 0) outside a process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def engine_config(b: SimpleNamespace, impl: str, strategy: str, *, batchnorm: bool,
                  **fields: Any) -> Any:
    """The program's EngineConfig. Where the models hold BatchNorm and the compat layer runs
    on several ranks, BatchNorm is synchronised (the batch statistics of the global batch,
    what one process computes): Betty has no such option, its DDP normalises each rank's
    slice on its own."""
    if impl == "compat" and batchnorm and place()[0] > 1:
        fields["strategy_options"] = {"sync_batchnorm": True}
    return b.EngineConfig(strategy=strategy, **fields)


def snapshot(problems: list[Any]) -> dict[str, torch.Tensor]:
    """Every problem's module state (parameters and buffers: BatchNorm's running statistics
    included) as detached CPU copies, named "<problem>.<state key>"."""
    return {f"{p.name}.{k}": v.detach().cpu().clone() for p in problems
            for k, v in p.module.state_dict().items()}


def learning_rates(problems: list[Any]) -> dict[str, list[float]]:
    """Each problem's learning rate per parameter group, as its optimizer holds them now."""
    return {p.name: [float(g["lr"]) for g in p.optimizer.param_groups] for p in problems}


class HiddenLayer(nn.Module):
    """The meta networks' layer in Betty's reweighting examples (bert_data_reweighting,
    imagenet_pruning): Linear then ReLU, its weights under ``fc``."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.fc(x))
        return out
