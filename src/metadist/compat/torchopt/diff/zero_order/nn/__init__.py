"""TorchOpt's ``torchopt.diff.zero_order.nn``."""

from metadist.compat.torchopt.diff.zero_order.nn.module import ZeroOrderGradientModule

__all__ = ["ZeroOrderGradientModule"]
