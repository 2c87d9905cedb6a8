"""How a ``parallelize``d function reaches the code that runs a part.

The decorator's wrapper is what a module-level name refers to, so under rpc the wrapper is
what pickles (by reference); whoever runs a part unwraps it and calls the function inside
instead of making another map-reduce call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

UNWRAPPED = "__metadist_unwrapped__"


def mark_wrapper(wrapper: Callable[..., Any], func: Callable[..., Any]) -> None:
    """Record that ``wrapper`` stands for ``func``."""
    setattr(wrapper, UNWRAPPED, func)


def inner_function(func: Callable[..., Any]) -> Callable[..., Any]:
    """The function a part should run: the one inside a ``parallelize`` wrapper, else ``func``."""
    inner: Callable[..., Any] = getattr(func, UNWRAPPED, func)
    return inner
