"""Loading: assemble and validate everything this rank will hold, then copy it in.

:func:`plan` reads, from any checkpoint, exactly what the objects here need on this rank (a
zero3 shard reads only the elements of its shard, wherever and by whichever layout they were
written) into new tensors, and checks every name, shape and parameter count on the way.
Nothing in memory changes until :meth:`Plan.apply`, which the caller runs only after every
rank reported success.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.checkpoint import rng
from metadist.checkpoint.capture import param_shapes, persistent_buffers
from metadist.checkpoint.entries import Entry, Key, describe, is_piece_tensor
from metadist.checkpoint.errors import CheckpointMismatchError, CorruptCheckpointError
from metadist.checkpoint.pieces import TensorInfo
from metadist.checkpoint.source import Source
from metadist.strategies.flat import SCALAR_STATE, FlatLayout, FlatParam
from metadist.strategies.fsdp import ShardedModule
from metadist.strategies.module import DistributedModule
from metadist.strategies.sharded_optim import _TAG, Sharding
from metadist.strategies.wrap import state_dict_key
from metadist.strategies.zero import OwnerLayout


@dataclass
class Plan:
    """A validated load: the copy-in steps, and the checkpoint's plain values."""

    actions: list[Callable[[], None]] = field(default_factory=list)
    plain: dict[str, Any] = field(default_factory=dict)

    def apply(self) -> None:
        for action in self.actions:
            action()


def _few(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _non_persistent(module: nn.Module) -> set[str]:
    return {state_dict_key(f"{prefix}.{n}" if prefix else n)
            for prefix, m in module.named_modules() for n in m._non_persistent_buffers_set}


class _Planner:
    def __init__(self, source: Source) -> None:
        self.source = source
        self.where = str(source.path)

    # ----- checks -------------------------------------------------------------------------
    def _check_keys(self, name: str, wanted: list[str], ignorable: set[str]) -> None:
        stored = self.source.entries[name].keys
        known, here = set(stored), set(wanted) | ignorable
        missing = [k for k in wanted if k not in known]
        unexpected = [k for k in stored if k not in here]
        if missing or unexpected:
            parts = ([f"lacks {_few(missing)}"] if missing else []) + (
                [f"has unexpected {_few(unexpected)}"] if unexpected else [])
            raise CheckpointMismatchError(
                f"{self.where}: {describe((name,))} does not match the module here: the "
                f"checkpoint {' and '.join(parts)}; it was saved from a different model")

    def _info(self, user: Key, stored: Key, shape: tuple[int, ...]) -> TensorInfo:
        info = self.source.tensors.get(stored)
        if info is None and stored not in self.source.values:
            raise CorruptCheckpointError(
                f"{self.where}: {describe(user)} is missing from the checkpoint (neither its "
                "tensor nor its value is stored); the checkpoint is corrupted, load another "
                "checkpoint")
        if info is None:
            found = type(self.source.values.get(stored)).__name__
            raise CheckpointMismatchError(f"{self.where}: {describe(user)} is a {found} in the "
                                          f"checkpoint; a tensor of shape {list(shape)} is "
                                          "expected here")
        if info.shape != shape:
            raise CheckpointMismatchError(
                f"{self.where}: {describe(user)} has shape {list(info.shape)} in the checkpoint "
                f"but {list(shape)} here; the checkpoint belongs to a different model")
        return info

    def _value(self, user: Key, stored: Key, like: Any) -> Any:
        if stored in self.source.values:
            value = self.source.values[stored]
            if isinstance(like, torch.Tensor) and (not isinstance(value, torch.Tensor)
                                                   or value.shape != like.shape):
                raise CheckpointMismatchError(f"{self.where}: {describe(user)} does not match "
                                              f"the {list(like.shape)}-shaped tensor here")
            return value
        # Not a value: a tensor of another shape, or nothing, is stored (_info says which).
        self._info(user, stored, tuple(like.shape) if isinstance(like, torch.Tensor) else ())
        raise CheckpointMismatchError(f"{self.where}: {describe(user)} is a tensor in the "
                                      f"checkpoint but a {type(like).__name__} here")

    def _read_slot(self, user: Key, stored: Key, shape: tuple[int, ...], offset: int,
                   lo: int, out: torch.Tensor) -> None:
        """Elements of a parameter at ``offset`` of a flat buffer that fall in ``out``, the
        shard starting at ``lo``."""
        info = self._info(user, stored, shape)
        a, b = max(lo, offset), min(lo + out.numel(), offset + info.numel)
        if a < b:
            self.source.read(stored, a - offset, b - offset, out[a - lo:b - lo])

    # ----- modules ------------------------------------------------------------------------
    def module(self, name: str, module: nn.Module) -> Callable[[], None]:
        if isinstance(module, ShardedModule):
            return self._sharded_module(name, module)
        inner = module.module if isinstance(module, DistributedModule) else module
        target = module.state_dict()
        self._check_keys(name, list(target), _non_persistent(inner))
        new: OrderedDict[str, Any] = OrderedDict()
        for key, like in target.items():
            stored = self.source.module_key(name, key)
            if is_piece_tensor(like):
                self._info((name, key), stored, tuple(like.shape))
                new[key] = self.source.full(stored)
            else:
                new[key] = self._value((name, key), stored, like)

        def apply() -> None:
            wait = getattr(module, "wait_params", None)
            if callable(wait):  # zero1/zero2: a refresh in flight must not land afterwards
                wait()
            module.load_state_dict(new)

        return apply

    def _sharded_module(self, name: str, module: ShardedModule) -> Callable[[], None]:
        wanted = [state_dict_key(n) for flat in module.flats for s in flat.slots
                  for n in (s.fqn, *s.aliases)]
        buffers = persistent_buffers(module.module)
        self._check_keys(name, wanted + [k for k, _ in buffers], _non_persistent(module.module))
        shards = []
        for flat in module.flats:
            shard = torch.zeros(flat.shard_size, dtype=flat.shard.dtype)
            for slot in flat.slots:
                key = state_dict_key(slot.fqn)
                self._read_slot((name, key), self.source.module_key(name, key),
                                tuple(slot.shape), slot.offset, flat.rank * flat.shard_size, shard)
            shards.append(shard)
        new_buffers = []
        for key, buf in buffers:
            stored = self.source.module_key(name, key)
            if is_piece_tensor(buf):
                self._info((name, key), stored, tuple(buf.shape))
                new_buffers.append((buf, self.source.full(stored)))
            else:
                new_buffers.append((buf, self._value((name, key), stored, buf)))

        def apply() -> None:
            with torch.no_grad():
                for flat, shard in zip(module.flats, shards, strict=True):
                    flat.shard.copy_(shard)
                for buf, value in new_buffers:
                    buf.copy_(value)
            module.after_step()  # drop gathered copies of the old parameters

        return apply

    # ----- optimizers ---------------------------------------------------------------------
    def optimizer(self, name: str, optimizer: Optimizer) -> Callable[[], None]:
        sharding: Sharding | None = getattr(optimizer, "metadist_sharding", None)
        groups = (sharding.original_groups if sharding is not None
                  else [list(g["params"]) for g in optimizer.param_groups])
        saved = self.source.param_groups.get(name)
        if saved is None:
            raise CorruptCheckpointError(f"{self.where}: the param groups of {describe((name,))} "
                                         "are missing; the checkpoint is corrupted")
        here, there = [len(g) for g in groups], [len(g["params"]) for g in saved]
        if here != there:
            raise CheckpointMismatchError(
                f"{self.where}: {describe((name,))} has {len(there)} param group(s) with "
                f"{there} parameters in the checkpoint but {len(here)} with {here} here; build "
                "the optimizer over the same parameters in the same order")
        shapes, saved_shapes = param_shapes(optimizer), self.source.entries[name].shapes
        for i, (a, b) in enumerate(zip(saved_shapes, shapes, strict=False)):
            if tuple(a) != tuple(b):
                raise CheckpointMismatchError(
                    f"{self.where}: {describe((name,))} parameter {i} has shape {list(a)} in the "
                    f"checkpoint but {list(b)} here; the checkpoint belongs to a different model")
        names = self.source.optimizer_state(name)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in saved]
        original = [p for g in groups for p in g]
        position = {id(p): i for i, p in enumerate(original)}
        layout = sharding.layout if sharding is not None else None
        state: dict[int, dict[str, Any]] = {}
        match layout:
            case None:
                for i in names:
                    state[i] = self._whole_entry(name, i, names[i])
                new_groups = [{**h, "params": list(range(sum(here[:k]), sum(here[:k + 1])))}
                              for k, h in enumerate(hyper)]
                sd: dict[str, Any] = {"state": state, "param_groups": new_groups}
            case OwnerLayout() | FlatLayout():
                flats = {id(f.shard): f for f in layout.flats} if isinstance(
                    layout, FlatLayout) else {}
                new_groups, j = [], 0
                for k, group in enumerate(optimizer.param_groups):
                    count = len(group["params"])
                    new_groups.append({**hyper[k], "params": list(range(j, j + count))})
                    for t in group["params"]:
                        entry = (self._flat_entry(name, flats[id(t)], position, names)
                                 if id(t) in flats else
                                 self._whole_entry(name, position[id(t)],
                                                   names.get(position[id(t)], [])))
                        if entry:
                            state[j] = entry
                        j += 1
                sd = {"state": state, "param_groups": new_groups, _TAG: layout.signature}
            case _:
                raise CheckpointMismatchError(
                    f"{describe((name,))} is sharded with a layout metadist cannot load into "
                    f"({type(layout).__name__})")
        return lambda: optimizer.load_state_dict(sd)

    def _whole_entry(self, name: str, i: int, state_names: list[str]) -> dict[str, Any]:
        out = {}
        for state_name in state_names:
            key = (name, str(i), state_name)
            out[state_name] = (self.source.full(key) if key in self.source.tensors
                               else self.source.values[key])
        return out

    def _flat_entry(self, name: str, flat: FlatParam, position: dict[int, int],
                    names: dict[int, list[str]]) -> dict[str, Any]:
        """This rank's shard of a flat buffer's state: per-element state cut from whatever
        pieces hold it (zeros where a parameter has none, and in the padding)."""
        indices = [position[id(p)] for p in flat.originals]
        lo = flat.rank * flat.shard_size
        out: dict[str, Any] = {}
        for state_name in sorted({n for i in indices for n in names.get(i, [])}):
            holders = [(slot, (name, str(i), state_name)) for slot, i in
                       zip(flat.slots, indices, strict=True) if state_name in names.get(i, [])]
            infos = [self.source.tensors.get(key) for _, key in holders]
            per_element = state_name not in SCALAR_STATE and all(
                info is not None and info.shape == tuple(slot.shape)
                for info, (slot, _) in zip(infos, holders, strict=True))
            if per_element:
                first = infos[0]
                assert first is not None
                buf = torch.zeros(flat.shard_size, dtype=first.dtype)
                for slot, key in holders:
                    self._read_slot(key, key, tuple(slot.shape), slot.offset, lo, buf)
                out[state_name] = buf
            else:  # per parameter (e.g. Adam's step): the same for the whole flat buffer
                key = holders[0][1]
                out[state_name] = (self.source.full(key) if key in self.source.tensors
                                   else self.source.values[key])
        return out


def _loader(obj: Any, saved: Any) -> Callable[[], None]:
    return lambda: obj.load_state_dict(saved)


def _setter(state: dict[str, Any], name: str, value: Any) -> Callable[[], None]:
    return lambda: state.__setitem__(name, value)


def plan(source: Source, entries: list[Entry], state: dict[str, Any], rank: int) -> Plan:
    """Assemble and check everything ``entries`` need from ``source`` on this rank."""
    out = Plan(plain=dict(source.plain))
    planner = _Planner(source)
    for e in entries:
        meta = source.entries.get(e.name)
        if meta is None:
            raise CheckpointMismatchError(
                f"{source.path} has no entry {e.name!r} (it holds: "
                f"{', '.join(source.entries) or 'nothing'}); drop {e.name!r} from the state you "
                "load, or load a checkpoint that has it")
        if meta.kind != e.kind:
            raise CheckpointMismatchError(f"{describe((e.name,))} is a {e.kind} here but "
                                          f"{source.path} holds a {meta.kind} under that name")
        match e.kind:
            case "module":
                out.actions.append(planner.module(e.name, e.value))
            case "optimizer":
                out.actions.append(planner.optimizer(e.name, e.value))
            case "stateful":
                if e.name not in source.stateful:
                    raise CorruptCheckpointError(f"{source.path}: the state of {e.name!r} is "
                                                 "missing; the checkpoint is corrupted")
                out.actions.append(_loader(e.value, source.stateful[e.name]))
            case "value":
                if e.name not in source.plain:
                    raise CorruptCheckpointError(f"{source.path}: the value {e.name!r} is "
                                                 "missing; the checkpoint is corrupted")
                out.actions.append(_setter(state, e.name, source.plain[e.name]))
    saved_rng = rng.pick(source.rng, rank)
    out.actions.append(lambda: rng.restore(saved_rng))
    return out
