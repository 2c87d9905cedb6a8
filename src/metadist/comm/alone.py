"""Regions of a program that one rank runs by itself (the engines' rank-0 validation), and
calls that every rank must make.

A collective in a region one rank runs alone cannot complete: the other ranks are elsewhere,
so it would wait until the collective timeout and then be reported as programs that
diverged. Every collective metadist runs passes :func:`refuse` first, which stops at once
inside such a region, naming the region, the collective and what to write instead.

Where metadist cannot know that a rank is alone (``if rank == 0: model.state_dict()`` under
zero3), the collectives a call issues carry its name (:func:`collective_call`), and a timeout
there says that the call is collective, not only that a rank did not arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from metadist.errors import CollectiveAloneError

_REGION: ContextVar[tuple[str, str] | None] = ContextVar("metadist_alone", default=None)
_CALL: ContextVar[str | None] = ContextVar("metadist_collective_call", default=None)


@contextmanager
def alone(region: str, instead: str) -> Iterator[None]:
    """Code run within is ``region``, run by this rank alone; ``instead``: what a program
    that needs the other ranks there should write."""
    token = _REGION.set((region, instead))
    try:
        yield
    finally:
        _REGION.reset(token)


def refuse(op: str) -> None:
    """Stop if ``op`` (a collective) is called from a region this rank runs alone."""
    known = _REGION.get()
    if known is None:
        return
    region, instead = known
    raise CollectiveAloneError(
        f"{op} is a collective, called from {region}, which this rank runs alone: the other "
        f"ranks are not there to join it, so it would wait until the collective timeout. "
        f"{instead}", op=op, region=region)


@contextmanager
def collective_call(call: str) -> Iterator[None]:
    """The collectives issued within belong to ``call`` (e.g. "model.state_dict()"), which
    every rank must make; the outermost such call names them."""
    token = _CALL.set(_CALL.get() or call)
    try:
        yield
    finally:
        _CALL.reset(token)


def current_call() -> str | None:
    """The collective call running on this thread, if any."""
    return _CALL.get()
