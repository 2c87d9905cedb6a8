"""Meta-learning building blocks: differentiable optimisers (object form bound to a module and
functional form on parameter pytrees), module cloning and snapshots for inner loops,
hypergradients of bilevel problems that stay exact across ranks, and the multilevel
Problem/Engine that runs them under any strategy."""

from metadist.meta.config import EarlyStopping, EngineConfig, ProblemConfig
from metadist.meta.engine import Engine
from metadist.meta.hypergrad import (
    METHODS,
    CGConfig,
    DartsConfig,
    HypergradConfig,
    NeumannConfig,
    UnrolledConfig,
    cg,
    darts,
    hypergradient,
    neumann,
    unrolled,
)
from metadist.meta.modules import (
    extract_state_dict,
    functional_call,
    module_clone,
    recover_state_dict,
)
from metadist.meta.optim import GradSync, MetaAdam, MetaAdamW, MetaOptimizer, MetaSGD
from metadist.meta.problem import Problem
from metadist.meta.transforms import (
    AdamState,
    SGDState,
    Transformation,
    adam,
    adamw,
    apply_updates,
    sgd,
)

__all__ = [
    "METHODS",
    "AdamState",
    "CGConfig",
    "DartsConfig",
    "EarlyStopping",
    "Engine",
    "EngineConfig",
    "GradSync",
    "HypergradConfig",
    "MetaAdam",
    "MetaAdamW",
    "MetaOptimizer",
    "MetaSGD",
    "NeumannConfig",
    "Problem",
    "ProblemConfig",
    "SGDState",
    "Transformation",
    "UnrolledConfig",
    "adam",
    "adamw",
    "apply_updates",
    "cg",
    "darts",
    "extract_state_dict",
    "functional_call",
    "hypergradient",
    "module_clone",
    "neumann",
    "recover_state_dict",
    "sgd",
    "unrolled",
]
