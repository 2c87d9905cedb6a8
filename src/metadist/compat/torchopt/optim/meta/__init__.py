"""TorchOpt's ``torchopt.optim.meta``: differentiable optimisers of a module."""

from metadist.compat.torchopt.optim.meta.adadelta import MetaAdaDelta, MetaAdadelta
from metadist.compat.torchopt.optim.meta.adagrad import MetaAdaGrad, MetaAdagrad
from metadist.compat.torchopt.optim.meta.adam import MetaAdam
from metadist.compat.torchopt.optim.meta.adamax import MetaAdaMax, MetaAdamax
from metadist.compat.torchopt.optim.meta.adamw import MetaAdamW
from metadist.compat.torchopt.optim.meta.base import MetaOptimizer
from metadist.compat.torchopt.optim.meta.radam import MetaRAdam
from metadist.compat.torchopt.optim.meta.rmsprop import MetaRMSProp, MetaRMSprop
from metadist.compat.torchopt.optim.meta.sgd import MetaSGD

__all__ = ["MetaAdaDelta", "MetaAdaGrad", "MetaAdaMax", "MetaAdadelta", "MetaAdagrad",
           "MetaAdam", "MetaAdamW", "MetaAdamax", "MetaOptimizer", "MetaRAdam", "MetaRMSProp",
           "MetaRMSprop", "MetaSGD"]
