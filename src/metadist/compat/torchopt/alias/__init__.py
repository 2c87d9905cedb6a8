"""TorchOpt's ``torchopt.alias``: the optimisers as chains of transformations."""

from metadist.compat.torchopt.alias import utils
from metadist.compat.torchopt.alias.adadelta import adadelta
from metadist.compat.torchopt.alias.adagrad import adagrad
from metadist.compat.torchopt.alias.adam import adam
from metadist.compat.torchopt.alias.adamax import adamax
from metadist.compat.torchopt.alias.adamw import adamw
from metadist.compat.torchopt.alias.radam import radam
from metadist.compat.torchopt.alias.rmsprop import rmsprop
from metadist.compat.torchopt.alias.sgd import sgd

__all__ = ["adadelta", "adagrad", "adam", "adamax", "adamw", "radam", "rmsprop", "sgd",
           "utils"]
