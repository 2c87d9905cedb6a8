"""A piece of fast weights that is a shard: operations across its elements stop.

Under zero3/hsdp a piece of ``model.fast_weights()`` is this rank's flat slice of several
parameters, under ddp a whole parameter. Element-wise arithmetic means the same on both;
anything that combines elements (a sum, a norm, a max, indexing, a reshape, concatenating
pieces) computes one thing under ddp and another under zero3, silently. A library that takes
fast weights as a pytree (an optimiser's transformation clipping by the norm of its leaves)
would do exactly that. So every sharded piece, and every tensor computed from one, is a
:class:`ShardPiece`, whose operators of that kind raise; metadist's own code that combines
pieces correctly (over every shard: ``fast.dot``, ``fast.norm``) runs inside
:func:`shard_internals`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from metadist.strategies.tensors.policy import (
    ACROSS,
    PLAIN,
    ElementWise,
    function_name,
    known_element_wise,
    masked_assignment,
)

_INTERNAL: ContextVar[bool] = ContextVar("metadist_shard_internals", default=False)

def internal() -> bool:
    """Whether metadist's own operations across pieces are running (:func:`shard_internals`)."""
    return _INTERNAL.get()


@contextmanager
def shard_internals() -> Iterator[None]:
    """Inside: metadist's own operations across pieces (which it makes global)."""
    token = _INTERNAL.set(True)
    try:
        yield
    finally:
        _INTERNAL.reset(token)


_FAST_ADVICE = (
    "on a piece of fast weights that are shards: under zero3/hsdp a piece is this rank's "
    "flat slice of several parameters (under ddp a whole parameter), so it would compute "
    "something else than one process. Use fast.dot(other) or fast.norm() for a sum over "
    "every parameter (one collective), fast.like({name: tensor}) for per-parameter values, "
    "or model.functional_forward(fast, ...) for anything that needs whole parameters")


class ShardPiece(Tensor):
    """A piece of shard fast weights, or a tensor computed from one (see the module
    notes): element-wise operators only."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = function_name(func)
        if name in PLAIN:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if _INTERNAL.get():
            return super().__torch_function__(func, types, args, kwargs)
        if masked_assignment(name, args) or known_element_wise(name):
            return super().__torch_function__(func, types, args, kwargs)
        if name in ACROSS:
            raise ValueError(f"fast-weight arithmetic ran {name}, which is not element-wise, "
                             + _FAST_ADVICE)
        with ElementWise(lambda op: f"fast-weight arithmetic ran {name}, which runs {op}, "
                         "not element-wise, " + _FAST_ADVICE):
            return super().__torch_function__(func, types, args, kwargs)


def as_piece(t: Tensor) -> Tensor:
    """``t`` as a :class:`ShardPiece` (the same data, still in its autograd graph)."""
    return t if isinstance(t, ShardPiece) else t.as_subclass(ShardPiece)


def plain(t: Tensor) -> Tensor:
    """``t`` as a plain tensor (the same data, still in its autograd graph)."""
    return t.as_subclass(Tensor) if isinstance(t, ShardPiece) else t
