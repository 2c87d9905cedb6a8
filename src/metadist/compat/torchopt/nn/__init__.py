"""TorchOpt's ``torchopt.nn``: modules with meta-parameters, the implicit and zero-order
gradient modules, and running a module on other tensors by name."""

from __future__ import annotations

import importlib
from typing import Any

from metadist.compat.torchopt._names import present_loaded
from metadist.compat.torchopt.nn.module import MetaGradientModule
from metadist.compat.torchopt.nn.stateless import reparameterize, reparametrize, swap_state

present_loaded()  # TorchOpt's module paths (_names.py)

__all__ = ["ImplicitMetaGradientModule", "MetaGradientModule", "ZeroOrderGradientModule",
           "reparameterize", "reparametrize", "swap_state"]

_FROM_DIFF = {"ImplicitMetaGradientModule": "implicit", "ZeroOrderGradientModule": "zero_order"}


def __getattr__(name: str) -> Any:
    """The gradient modules live in ``diff``, whose modules import this package's: loaded on
    first use, so either package may be imported first."""
    if name in _FROM_DIFF:
        module = importlib.import_module(
            f"metadist.compat.torchopt.diff.{_FROM_DIFF[name]}.nn.module")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
