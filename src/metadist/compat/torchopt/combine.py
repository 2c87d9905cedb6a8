"""TorchOpt's ``chain`` and ``chain.flat`` (the members work on the flattened leaves)."""

from __future__ import annotations

from typing import Any

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.base import (
    ChainedGradientTransformation,
    GradientTransformation,
    identity,
)

__all__ = ["chain", "chain_flat"]


def chain(*transformations: GradientTransformation) -> GradientTransformation:
    """Apply ``transformations`` in order (state: the tuple of their states)."""
    if not transformations:
        return identity()
    if len(transformations) == 1:
        return transformations[0]
    return ChainedGradientTransformation(*transformations)


def chain_flat(*transformations: GradientTransformation) -> GradientTransformation:
    """:func:`chain` of transformations written for flattened leaves (``None`` leaves kept in
    place); the updates come back in the tree's structure."""
    if not transformations:
        return identity()
    inner = chain(*transformations)

    def init(params: Any) -> Any:
        return inner.init(_tree.leaves(params, none_is_leaf=True))

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True
               ) -> tuple[Any, Any]:
        flat, spec = _tree.flatten(updates)
        flat_params = None if params is None else _tree.leaves(params, none_is_leaf=True)
        flat, state = inner.update(flat, state, params=flat_params, inplace=inplace)
        return _tree.unflatten(spec, flat), state

    return GradientTransformation(init, update)


chain.flat = chain_flat  # type: ignore[attr-defined]
