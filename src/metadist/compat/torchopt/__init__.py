"""TorchOpt's API on metadist: ``import torchopt`` becomes
``import metadist.compat.torchopt as torchopt`` (and ``import torchopt.distributed as todist``
``import metadist.compat.torchopt.distributed as todist``), and nothing else changes.

Names, signatures (positional order included), defaults and semantics are TorchOpt 0.7.3's;
the arithmetic is metadist's differentiable optimisers (:mod:`metadist.meta`), the
distributed calls metadist's map-reduce engines. docs/mapreduce.md ("Coming from TorchOpt")
lists what differs and why.
"""

from metadist.compat.torchopt import alias, optim, update, utils
from metadist.compat.torchopt.alias import (
    GradientTransformation,
    adadelta,
    adagrad,
    adam,
    adamax,
    adamw,
    chain,
    clip_grad_norm,
    nan_to_num,
    radam,
    rmsprop,
    sgd,
)
from metadist.compat.torchopt.optim import (
    SGD,
    AdaDelta,
    AdaGrad,
    Adam,
    AdaMax,
    AdamW,
    FuncOptimizer,
    MetaAdaDelta,
    MetaAdaGrad,
    MetaAdam,
    MetaAdaMax,
    MetaAdamW,
    MetaOptimizer,
    MetaRAdam,
    MetaRMSProp,
    MetaSGD,
    Optimizer,
    RAdam,
    RMSProp,
)
from metadist.compat.torchopt.update import apply_updates
from metadist.compat.torchopt.utils import (
    ModuleState,
    extract_state_dict,
    module_clone,
    module_detach_,
    recover_state_dict,
    stop_gradient,
)

# TorchOpt's second spellings
Adamax, Adadelta, Adagrad, RMSprop = AdaMax, AdaDelta, AdaGrad, RMSProp
MetaAdamax, MetaAdadelta, MetaAdagrad, MetaRMSprop = (MetaAdaMax, MetaAdaDelta, MetaAdaGrad,
                                                      MetaRMSProp)
__version__ = "0.7.3"


def accelerated_op_available(devices: object = None) -> bool:
    """TorchOpt's fused C++/CUDA kernels are not used here (the same arithmetic runs as torch
    operations), so an accelerated op is never available."""
    return False


__all__ = [
    "SGD",
    "AdaDelta",
    "AdaGrad",
    "AdaMax",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "FuncOptimizer",
    "GradientTransformation",
    "MetaAdaDelta",
    "MetaAdaGrad",
    "MetaAdaMax",
    "MetaAdadelta",
    "MetaAdagrad",
    "MetaAdam",
    "MetaAdamW",
    "MetaAdamax",
    "MetaOptimizer",
    "MetaRAdam",
    "MetaRMSProp",
    "MetaRMSprop",
    "MetaSGD",
    "ModuleState",
    "Optimizer",
    "RAdam",
    "RMSProp",
    "RMSprop",
    "accelerated_op_available",
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "alias",
    "apply_updates",
    "chain",
    "clip_grad_norm",
    "extract_state_dict",
    "module_clone",
    "module_detach_",
    "nan_to_num",
    "optim",
    "radam",
    "recover_state_dict",
    "rmsprop",
    "sgd",
    "stop_gradient",
    "update",
    "utils",
]
