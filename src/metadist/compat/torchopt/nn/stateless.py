"""TorchOpt's ``torchopt.nn.stateless``: run a module on other tensors by name.

``swap_state(module, {"fc.weight": w, ...})`` writes each tensor where the name's attribute
lives (the owning module's ``_parameters``, ``_buffers`` or, on a
:class:`~metadist.compat.torchopt.nn.MetaGradientModule`, ``_meta_parameters``; else a plain
attribute) and returns what was there; ``reparametrize`` does it for a ``with`` block and
puts the originals back on exit, exceptions included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["reparameterize", "reparametrize", "swap_state"]

#: the value ``swap_state(..., allow_missing=True)`` returns for a name with no attribute, and
#: the value that deletes the attribute when swapped back
MISSING: torch.Tensor = object()  # type: ignore[assignment]

NamedTensors = dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

_SLOTS = ("_parameters", "_buffers", "_meta_parameters")


def _owner(root: nn.Module, path: str, cache: dict[str, nn.Module]) -> nn.Module:
    if path not in cache:
        parent, _, attr = path.rpartition(".")
        cache[path] = getattr(_owner(root, parent, cache), attr)
    return cache[path]


def _put(owner: nn.Module, attr: str, value: torch.Tensor) -> None:
    if value is MISSING:
        delattr(owner, attr)
        return
    for slot in _SLOTS:
        entries = owner.__dict__.get(slot)
        if entries is not None and attr in entries:
            entries[attr] = value  # a non-leaf tensor too: nn.Module.__setattr__ would refuse
            return
    setattr(owner, attr, value)


def swap_state(module: nn.Module, named_tensors: NamedTensors,
               allow_missing: bool = False) -> dict[str, torch.Tensor]:
    """Write each named tensor into ``module`` and return the tensors it replaced, by name
    (``MISSING`` for an attribute that was not there, with ``allow_missing``; without it a
    missing attribute raises ``AttributeError``)."""
    named = dict(named_tensors)
    cache: dict[str, nn.Module] = {"": module}
    old: dict[str, torch.Tensor] = {}
    for name, value in named.items():
        parent, _, attr = name.rpartition(".")
        owner = _owner(module, parent, cache)
        old[name] = getattr(owner, attr, MISSING) if allow_missing else getattr(owner, attr)
        _put(owner, attr, value)
    return old


@contextlib.contextmanager
def reparametrize(module: nn.Module, named_tensors: NamedTensors,
                  allow_missing: bool = False) -> Generator[nn.Module, None, None]:
    """``module`` with the named tensors swapped in for the ``with`` block."""
    old: dict[str, Any] = {}
    try:
        old = swap_state(module, named_tensors, allow_missing=allow_missing)
        yield module
    finally:
        swap_state(module, old, allow_missing=allow_missing)


reparameterize = reparametrize
