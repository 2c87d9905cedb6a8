"""TorchOpt's ``torchopt.optim.func``."""

from metadist.compat.torchopt.optim.func.base import FuncOptimizer

__all__ = ["FuncOptimizer"]
