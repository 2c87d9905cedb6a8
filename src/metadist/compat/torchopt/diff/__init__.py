"""TorchOpt's ``torchopt.diff``: implicit and zero-order differentiation."""

from metadist.compat.torchopt.diff import implicit, zero_order
from metadist.compat.torchopt.diff.implicit import ImplicitMetaGradientModule
from metadist.compat.torchopt.diff.zero_order import ZeroOrderGradientModule

__all__ = ["ImplicitMetaGradientModule", "ZeroOrderGradientModule", "implicit", "zero_order"]
