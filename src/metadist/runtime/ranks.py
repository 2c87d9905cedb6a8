"""Run code on chosen ranks only; print and log with the rank attached.

The rank is read when the decorated function is *called*, not when it is decorated, and
before :func:`metadist.init` it comes from the launcher's environment, so module-level
decorators work in scripts started by any launcher.
"""

from __future__ import annotations

import builtins
import functools
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from metadist.runtime import env as launch_env
from metadist.runtime import world as _world

P = ParamSpec("P")
R = TypeVar("R")


def current_rank() -> int:
    """Global rank of this process; works before :func:`metadist.init`."""
    if _world.is_initialized():
        return _world.world().rank
    return launch_env.detect().rank


def _only_if(predicate: Callable[[int], bool]) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return fn(*args, **kwargs) if predicate(current_rank()) else None

        return wrapper

    return decorate


def on_rank(*ranks: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorator: run only on the given global ranks; other ranks get ``None``."""
    if not ranks:
        raise ValueError("on_rank() needs at least one rank, e.g. @on_rank(0, 1)")
    chosen = frozenset(ranks)
    return _only_if(lambda r: r in chosen)


def not_on_rank(*ranks: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorator: run on every rank except the given ones; those get ``None``."""
    if not ranks:
        raise ValueError("not_on_rank() needs at least one rank, e.g. @not_on_rank(0)")
    excluded = frozenset(ranks)
    return _only_if(lambda r: r not in excluded)


def rank_zero_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Decorator: run only on global rank 0 (checkpoints, logging of results)."""
    return on_rank(0)(fn)


def rank_non_zero_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Decorator: run on every rank but 0."""
    return not_on_rank(0)(fn)


def print(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only; accepts the builtin's arguments."""
    if current_rank() == 0:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


class _RankFilter(logging.Filter):
    """Stamp every record with ``record.rank`` (and world size) at the moment it is emitted."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        record.world_size = _world.world().world_size if _world.is_initialized() else None
        return True


_FORMAT = "[%(asctime)s rank %(rank)s] %(levelname)s %(name)s: %(message)s"


def get_logger(name: str | None = None) -> logging.Logger:
    """A logger under ``metadist`` whose records carry ``rank``.

    The ``metadist`` logger gets one stream handler showing the rank, unless the application
    configured a handler for it already; set its level as usual.
    """
    root = logging.getLogger("metadist")
    if not any(isinstance(f, _RankFilter) for f in root.filters):
        root.addFilter(_RankFilter())
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler.addFilter(_RankFilter())
            root.addHandler(handler)
            root.propagate = False
    logger = root if name in (None, "", "metadist") else logging.getLogger(
        name if name.startswith("metadist.") else f"metadist.{name}"
    )
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    return logger
