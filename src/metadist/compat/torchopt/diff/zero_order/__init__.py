"""TorchOpt's ``torchopt.diff.zero_order``: zero-order gradient estimation. As in TorchOpt,
the module itself is callable: ``torchopt.diff.zero_order(...)`` is
``torchopt.diff.zero_order.zero_order(...)``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from metadist.compat.torchopt.diff.zero_order import nn
from metadist.compat.torchopt.diff.zero_order.decorator import zero_order
from metadist.compat.torchopt.diff.zero_order.nn import ZeroOrderGradientModule

__all__ = ["ZeroOrderGradientModule", "zero_order"]


class _CallableModule(ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        return zero_order(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
_ = nn
