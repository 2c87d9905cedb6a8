"""TorchOpt's ``torchopt.diff.implicit``: implicit differentiation (``custom_root``,
``ImplicitMetaGradientModule``) on metadist's :func:`~metadist.meta.hypergrad.root_vjp`."""

from metadist.compat.torchopt.diff.implicit import nn  # noqa: F401 - torchopt.diff.implicit.nn
from metadist.compat.torchopt.diff.implicit.decorator import custom_root
from metadist.compat.torchopt.diff.implicit.nn import ImplicitMetaGradientModule

__all__ = ["ImplicitMetaGradientModule", "custom_root"]
