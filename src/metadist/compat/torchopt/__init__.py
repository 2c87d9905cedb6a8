"""TorchOpt's API on metadist: ``import torchopt`` becomes
``import metadist.compat.torchopt as torchopt`` (and ``import torchopt.distributed as todist``
``import metadist.compat.torchopt.distributed as todist``), and nothing else changes.

Names, signatures (positional order included), defaults, module paths and semantics are
TorchOpt 0.7.3's, and so are the numbers: the optimisers are TorchOpt's chains of
transformations (:mod:`.transform`, :mod:`.alias`) with TorchOpt's arithmetic; implicit
differentiation (:mod:`.diff.implicit`, :mod:`.linear_solve`) runs on metadist's
hypergradient solvers, the distributed calls on metadist's map-reduce engines.
docs/mapreduce.md ("Coming from TorchOpt") lists what differs and why.

``pytree`` needs optree and ``visual`` graphviz, as TorchOpt's do; both, and the heavier
subpackages, load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from metadist.compat.torchopt import (
    accelerated_op,
    alias,
    base,
    clip,
    combine,
    hook,
    optim,
    schedule,
    transform,
    typing,
    update,
    utils,
)
from metadist.compat.torchopt._names import present_loaded
from metadist.compat.torchopt.accelerated_op import is_available as accelerated_op_available
from metadist.compat.torchopt.alias import (
    adadelta,
    adagrad,
    adam,
    adamax,
    adamw,
    radam,
    rmsprop,
    sgd,
)
from metadist.compat.torchopt.base import GradientTransformation
from metadist.compat.torchopt.clip import clip_grad_norm
from metadist.compat.torchopt.combine import chain
from metadist.compat.torchopt.hook import register_hook
from metadist.compat.torchopt.optim import (
    SGD,
    AdaDelta,
    Adadelta,
    AdaGrad,
    Adagrad,
    Adam,
    AdaMax,
    Adamax,
    AdamW,
    Optimizer,
    RAdam,
    RMSProp,
    RMSprop,
)
from metadist.compat.torchopt.optim.func import FuncOptimizer
from metadist.compat.torchopt.optim.meta import (
    MetaAdaDelta,
    MetaAdadelta,
    MetaAdaGrad,
    MetaAdagrad,
    MetaAdam,
    MetaAdaMax,
    MetaAdamax,
    MetaAdamW,
    MetaOptimizer,
    MetaRAdam,
    MetaRMSProp,
    MetaRMSprop,
    MetaSGD,
)
from metadist.compat.torchopt.transform import nan_to_num
from metadist.compat.torchopt.update import apply_updates
from metadist.compat.torchopt.utils import (
    ModuleState,
    extract_state_dict,
    module_clone,
    module_detach_,
    recover_state_dict,
    stop_gradient,
)
from metadist.compat.torchopt.version import __version__

present_loaded()  # TorchOpt's module paths (_names.py)

_LAZY = ("diff", "distributed", "linalg", "linear_solve", "nn", "pytree", "visual")


def __getattr__(name: str) -> Any:
    """The subpackages that need optional dependencies (optree, graphviz) or more set-up,
    imported on first use."""
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SGD", "AdaDelta", "AdaGrad", "AdaMax", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax",
    "FuncOptimizer", "GradientTransformation", "MetaAdaDelta", "MetaAdaGrad", "MetaAdaMax",
    "MetaAdadelta", "MetaAdagrad", "MetaAdam", "MetaAdamW", "MetaAdamax", "MetaOptimizer",
    "MetaRAdam", "MetaRMSProp", "MetaRMSprop", "MetaSGD", "ModuleState", "Optimizer", "RAdam",
    "RMSProp", "RMSprop", "__version__", "accelerated_op", "accelerated_op_available",
    "adadelta", "adagrad", "adam", "adamax", "adamw", "alias", "apply_updates", "base",
    "chain", "clip", "clip_grad_norm", "combine", "extract_state_dict", "hook", "module_clone",
    "module_detach_", "nan_to_num", "optim", "radam", "recover_state_dict", "register_hook",
    "rmsprop", "schedule", "sgd", "stop_gradient", "transform", "typing", "update", "utils",
]
