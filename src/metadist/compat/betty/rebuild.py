"""Betty's rebuild of a problem's optimizer and scheduler: Betty steps an optimizer of the
given class built from its defaults over the parameters it trains, so the drop-in rebuilds
one the same way wherever Betty would (at set-up, and in ``set_optimizer``/``set_scheduler``).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from torch.optim import Optimizer


def betty_optimizer(problem: Any, optimizer: Optimizer, module: nn.Module) -> Optimizer:
    """Betty steps ``type(optimizer)(params, **optimizer.defaults)`` with params its
    ``param_groups()`` hook or all of the module's parameters. The user's object is kept
    when it already is exactly that; otherwise it is rebuilt (and its scheduler with it,
    :func:`betty_scheduler`), as Betty does."""
    hook = getattr(problem, "param_groups", None)
    groups = list(hook()) if callable(hook) else [{"params": list(module.parameters())}]
    groups = [g if isinstance(g, dict) else {"params": [g]} for g in groups]
    wanted = [{**optimizer.defaults, **g, "params": list(g["params"])} for g in groups]
    have = [{k: v for k, v in g.items() if k in wanted[0]} for g in optimizer.param_groups]
    same = len(have) == len(wanted) and all(
        [id(p) for p in h["params"]] == [id(p) for p in w["params"]]
        and all(h.get(k) == v for k, v in w.items() if k != "params")
        for h, w in zip(have, wanted, strict=True))
    if same:
        return optimizer
    # Only what the constructor takes (torch's AdamW keeps "decoupled_weight_decay" in its
    # defaults but does not accept it: Betty 0.2.1 fails there).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items()
                                      if k in accepted})


def betty_scheduler(problem: Any, scheduler: Any, optimizer: Optimizer) -> Any:
    """Betty's rebuild of a scheduler on the rebuilt optimizer: its constructor called with
    the arguments read back from the scheduler's attributes, ``last_epoch`` one less (the
    constructor steps once), LambdaLR's functions from ``lr_lambdas``."""
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(type(scheduler).__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name == "optimizer":
            kwargs[name] = optimizer
        elif name == "last_epoch":
            kwargs[name] = scheduler.last_epoch - 1
        elif name == "lr_lambda":
            kwargs[name] = scheduler.lr_lambdas
        elif hasattr(scheduler, name):
            kwargs[name] = getattr(scheduler, name)
        elif param.default is param.empty:
            raise ValueError(
                f"problem {problem._betty_name!r}: Betty rebuilds the optimizer from its "
                "defaults (over param_groups() or the module's parameters) and the scheduler "
                f"from its attributes, but {type(scheduler).__name__} keeps no attribute "
                f"{name!r} to rebuild it with; build the optimizer with its settings as "
                "defaults over the parameters Betty steps, so that nothing is rebuilt")
    return type(scheduler)(**kwargs)
