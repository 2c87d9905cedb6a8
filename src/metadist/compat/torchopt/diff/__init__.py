"""TorchOpt's ``torchopt.diff``: implicit and zero-order differentiation."""

from metadist.compat.torchopt._names import present_loaded
from metadist.compat.torchopt.diff import implicit, zero_order
from metadist.compat.torchopt.diff.implicit import ImplicitMetaGradientModule
from metadist.compat.torchopt.diff.zero_order import ZeroOrderGradientModule

present_loaded()  # TorchOpt's module paths (_names.py)

__all__ = ["ImplicitMetaGradientModule", "ZeroOrderGradientModule", "implicit", "zero_order"]
