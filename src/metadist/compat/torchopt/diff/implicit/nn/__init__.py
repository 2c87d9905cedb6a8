"""TorchOpt's ``torchopt.diff.implicit.nn``."""

from metadist.compat.torchopt.diff.implicit.nn.module import ImplicitMetaGradientModule

__all__ = ["ImplicitMetaGradientModule"]
