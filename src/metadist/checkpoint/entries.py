"""What a user's ``state`` dict holds, and the names its tensors get inside a checkpoint.

Each value of ``state`` is one *entry* of a kind:

* ``"module"``: an ``nn.Module`` (usually the DistributedModule from ``strategy.setup``);
  its state dict in the user's module's keys.
* ``"optimizer"``: a ``torch.optim.Optimizer`` (sharded or not); its state in the plain
  single-process format, by parameter index across the param groups.
* ``"stateful"``: anything else with ``state_dict()`` / ``load_state_dict()`` (LR scheduler,
  loss scaler, the distributed data loader); saved from rank 0.
* ``"value"``: plain data (numbers, strings, None, tensors, lists/tuples/dicts of those).

A top-level ``None`` (e.g. ``strategy.scaler`` without a loss scaler) is skipped.
Inside a checkpoint a tensor is named by a :data:`Key`: ``(entry, state-dict key)`` for
modules, ``(entry, parameter index, state name)`` for optimizer state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from metadist.checkpoint.errors import CheckpointError

Kind = Literal["module", "optimizer", "stateful", "value"]
KINDS: tuple[Kind, ...] = ("module", "optimizer", "stateful", "value")
Key = tuple[str, ...]

#: the full format's top-level key for metadist's own header; not usable as an entry name
HEADER = "metadist"


@dataclass(frozen=True)
class Entry:
    name: str
    kind: Kind
    value: Any


def describe(key: Key) -> str:
    """A key as the user would index their state: ``state['model']['inp.weight']``."""
    if len(key) == 3:
        return f"state[{key[0]!r}] parameter {key[1]} {key[2]!r}"
    return "state" + "".join(f"[{part!r}]" for part in key)


def kind_of(name: str, value: Any) -> Kind | None:
    """The kind of ``state[name]`` (None: skipped); raises for values a checkpoint cannot hold."""
    if value is None:
        return None
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, Optimizer):
        return "optimizer"
    if callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)):
        return "stateful"
    if isinstance(value, DataLoader):
        raise CheckpointError(
            f"{describe((name,))} is a DataLoader, whose position a checkpoint cannot record; "
            "save the loader returned by strategy.setup_dataloader(loader) (it has "
            "state_dict()), or leave it out of the state")
    check_plain(value, describe((name,)))
    return "value"


def entries_of(state: Mapping[str, Any]) -> list[Entry]:
    """Classify every value of a user's ``state`` dict (None values skipped)."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict of name -> object, got {type(state).__name__}")
    out = []
    for name, value in state.items():
        if not isinstance(name, str) or name == HEADER:
            raise CheckpointError(
                f"state key {name!r} cannot be used: keys must be strings other than "
                f"{HEADER!r} (reserved for the checkpoint's own header); rename it")
        kind = kind_of(name, value)
        if kind is not None:
            out.append(Entry(name, kind, value))
    return out


# Types torch.load(weights_only=True) rebuilds without running arbitrary code.
_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            torch.Size)


def check_plain(value: Any, where: str) -> None:
    """Raise :class:`CheckpointError` unless ``value`` loads back under ``weights_only=True``."""
    if isinstance(value, (*_SCALARS, torch.Tensor)):
        return
    if type(value) in (list, tuple, set):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if type(value) in (dict, OrderedDict):
        for k, item in value.items():
            if not isinstance(k, _SCALARS):
                raise CheckpointError(
                    f"{where} has a key of type {type(k).__name__}; a checkpoint stores only "
                    "plain keys (str, int, float, bool, None)")
            check_plain(item, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a safe "
        "checkpoint cannot store (loading never unpickles arbitrary objects). Store plain "
        "values (numbers, strings, None, tensors, lists/tuples/dicts of those) or give the "
        "object state_dict()/load_state_dict()")


def plain_copy(value: Any, private: bool = False) -> Any:
    """``value`` with every tensor detached onto the CPU (checkpoints load anywhere);
    ``private``: each tensor a copy of its own, sharing storage with nothing."""
    if isinstance(value, torch.Tensor):
        out = value.detach().cpu()
        return out.clone() if private else out
    if type(value) in (list, tuple, set):
        return type(value)(plain_copy(v, private) for v in value)
    if type(value) in (dict, OrderedDict):
        return type(value)((k, plain_copy(v, private)) for k, v in value.items())
    return value


def is_piece_tensor(value: Any) -> bool:
    """Tensors of one or more dimensions are stored as pieces; scalars and the rest as values."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1
