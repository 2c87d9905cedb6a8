"""TorchOpt's ``torchopt.optim``: torch-style optimisers, ``func`` and ``meta``."""

from metadist.compat.torchopt.optim import func, meta
from metadist.compat.torchopt.optim.adadelta import AdaDelta, Adadelta
from metadist.compat.torchopt.optim.adagrad import AdaGrad, Adagrad
from metadist.compat.torchopt.optim.adam import Adam
from metadist.compat.torchopt.optim.adamax import AdaMax, Adamax
from metadist.compat.torchopt.optim.adamw import AdamW
from metadist.compat.torchopt.optim.base import Optimizer
from metadist.compat.torchopt.optim.func import FuncOptimizer
from metadist.compat.torchopt.optim.radam import RAdam
from metadist.compat.torchopt.optim.rmsprop import RMSProp, RMSprop
from metadist.compat.torchopt.optim.sgd import SGD

__all__ = ["SGD", "AdaDelta", "AdaGrad", "AdaMax", "Adadelta", "Adagrad", "Adam", "AdamW",
           "Adamax", "FuncOptimizer", "Optimizer", "RAdam", "RMSProp", "RMSprop", "func",
           "meta"]
