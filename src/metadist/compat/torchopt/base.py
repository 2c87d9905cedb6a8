"""TorchOpt's ``torchopt.base``: a gradient transformation is the NamedTuple ``(init,
update)``; a chain of them is a :class:`ChainedGradientTransformation` (nested chains are
flattened, identities dropped); :func:`identity` changes nothing."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["ChainedGradientTransformation", "EmptyState", "GradientTransformation",
           "UninitializedState", "identity"]


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class UninitializedState(NamedTuple):
    """A state to be built by ``init`` on first use (the optimiser classes' lazy init)."""


class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(updates, state, *, params=None, inplace=True)
    -> (updates, state)``; with ``inplace`` the given updates and state are modified."""

    init: Callable[..., Any]
    update: Callable[..., Any]

    def chain(self, next: GradientTransformation) -> ChainedGradientTransformation:
        return ChainedGradientTransformation(self, next)


class ChainedGradientTransformation(GradientTransformation):
    """Several transformations applied in order; the state is the tuple of their states."""

    transformations: tuple[GradientTransformation, ...]

    def __new__(cls, *transformations: GradientTransformation) -> ChainedGradientTransformation:
        members = tuple(itertools.chain.from_iterable(
            t.transformations if isinstance(t, ChainedGradientTransformation)
            else (() if isinstance(t, IdentityGradientTransformation) else (t,))
            for t in transformations))
        if not members:
            members = (IdentityGradientTransformation(),)

        def init(params: Any) -> Any:
            return tuple(t.init(params) for t in members)

        def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
                   ) -> tuple[Any, Any]:
            if len(state) != len(members):
                raise ValueError("The number of updates and states has to be the same in "
                                 "chain! Make sure you have called init first!")
            new = []
            for t, old in zip(members, state, strict=True):
                updates, fresh = t.update(updates, old, params=params, inplace=inplace)
                new.append(fresh)
            return updates, tuple(new)

        self = super().__new__(cls, init, update)
        self.transformations = members
        return self

    def __repr__(self) -> str:
        inner = ",\n    ".join(repr(t) for t in self.transformations)
        return f"{type(self).__name__}(\n    {inner},\n)"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChainedGradientTransformation):
            return self.transformations == other.transformations
        if isinstance(other, GradientTransformation):
            return self.transformations == (other,)
        return False

    def __hash__(self) -> int:
        return hash(self.transformations)

    def __getstate__(self) -> tuple[GradientTransformation, ...]:
        return self.transformations

    def __setstate__(self, state: tuple[GradientTransformation, ...]) -> None:
        self.transformations = state

    def __reduce__(self) -> tuple[Any, ...]:
        return ChainedGradientTransformation, self.transformations


class IdentityGradientTransformation(GradientTransformation):
    """Leaves the updates as they are (state: :class:`EmptyState`)."""

    def __new__(cls) -> IdentityGradientTransformation:
        return super().__new__(cls, cls.init_fn, cls.update_fn)

    @staticmethod
    def init_fn(params: Any) -> EmptyState:
        return EmptyState()

    @staticmethod
    def update_fn(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
                  ) -> tuple[Any, Any]:
        return updates, state


def identity() -> IdentityGradientTransformation:
    """The transformation that passes the updates through unchanged."""
    return IdentityGradientTransformation()
