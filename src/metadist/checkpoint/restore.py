"""Loading: assemble and validate everything this rank will hold, then copy it in.

:func:`plan` reads, from any checkpoint, exactly what the objects here need on this rank (a
zero3 shard reads only the elements of its shard, wherever and by whichever layout they were
written) into new tensors, and checks every name, shape and parameter count on the way.
Nothing in memory changes until :meth:`Plan.apply`, which the caller runs only after every
rank reported success.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.checkpoint import rng
from metadist.checkpoint.capture import module_placement
from metadist.checkpoint.entries import Entry, Key, describe
from metadist.checkpoint.errors import CheckpointMismatchError, CorruptCheckpointError
from metadist.checkpoint.pieces import TensorInfo
from metadist.checkpoint.source import Source
from metadist.strategies.own_state import OWN, Own, own_states
from metadist.strategies.placement import (
    Stepped,
    numbered_groups,
    optimizer_placement,
    per_element,
)


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
            value = self.source.value(stored)
            if isinstance(like, torch.Tensor) and (not isinstance(value, torch.Tensor)
                                                   or value.shape != like.shape):
                raise CheckpointMismatchError(f"{self.where}: {describe(user)} does not match "
                                              f"the {list(like.shape)}-shaped tensor here")
            return value
        info = self.source.tensors.get(stored)
        if isinstance(like, torch.Tensor) and info is not None and info.shape == like.shape:
            return self.source.full(stored)  # 0-dim, stored as a tensor by a sharded layout
        # Not a value: a tensor of another shape, or nothing, is stored (_info says which).
        self._info(user, stored, tuple(like.shape) if isinstance(like, torch.Tensor) else ())
        raise CheckpointMismatchError(f"{self.where}: {describe(user)} is a tensor in the "
                                      f"checkpoint but a {type(like).__name__} here")

    # ----- modules ------------------------------------------------------------------------
    def module(self, name: str, module: nn.Module) -> Callable[[], None]:
        where = module_placement(module)
        self._check_keys(name, list(where.keys), set(where.ignorable))
        parts: dict[str, list[torch.Tensor]] = {}
        for placement in where.tensors:
            stored = self.source.module_key(name, placement.name)
            value = self.source.values.get(stored)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == placement.shape:
                # 0-dim, stored as a value by a layout that held it whole
                parts[placement.name] = [value.reshape(-1)[p.start:p.stop]
                                         for p in placement.parts]
                continue
            self._info((name, placement.name), stored, placement.shape)
            parts[placement.name] = [self._read(stored, p.start, p.stop)
                                     for p in placement.parts]
        values = {key: self._value((name, key), self.source.module_key(name, key), like)
                  for key, like in where.values.items()}
        return lambda: where.load(parts, values)

    def _read(self, stored: Key, start: int, stop: int) -> torch.Tensor:
        info = self.source.tensors[stored]
        out = torch.empty(stop - start, dtype=info.dtype)
        self.source.read(stored, start, stop, out)
        return out

    # ----- optimizers ---------------------------------------------------------------------
    def optimizer(self, name: str, optimizer: Optimizer) -> Callable[[], None]:
        where = optimizer_placement(optimizer)
        saved = self.source.param_groups.get(name)
        if saved is None:
            raise CorruptCheckpointError(f"{self.where}: the param groups of {describe((name,))} "
                                         "are missing; the checkpoint is corrupted")
        _check_optimizer_class(f"{self.where}: {describe((name,))}", optimizer, saved)
        here, there = list(where.counts), [len(g["params"]) for g in saved]
        if here != there:
            raise CheckpointMismatchError(
                f"{self.where}: {describe((name,))} has {len(there)} param group(s) with "
                f"{there} parameters in the checkpoint but {len(here)} with {here} here; build "
                "the optimizer over the same parameters in the same order")
        for i, (a, b) in enumerate(zip(self.source.entries[name].shapes, where.shapes,
                                       strict=False)):
            if tuple(a) != tuple(b):
                raise CheckpointMismatchError(
                    f"{self.where}: {describe((name,))} parameter {i} has shape {list(a)} in the "
                    f"checkpoint but {list(b)} here; the checkpoint belongs to a different model")
        names = self.source.optimizer_state(name)
        state: dict[int, dict[str, Any]] = {}
        own: dict[int, Own] = {}
        for j, s in enumerate(where.stepped):
            entry, own[j] = self._stepped_entry(name, s, names)
            if entry:
                state[j] = entry
        groups = numbered_groups(saved, [len(g["params"]) for g in optimizer.param_groups])
        sd = {"state": state, "param_groups": groups, **where.tag,
              **({OWN: {j: o for j, o in own.items() if o}} if where.tag else {})}
        return lambda: optimizer.load_state_dict(sd)

    def _stepped_entry(self, name: str, s: Stepped, names: dict[int, list[str]]
                       ) -> tuple[dict[str, Any], Own]:
        """The state of one tensor this rank steps: per-element state cut from whatever
        pieces hold it (zeros where a parameter has none, and in padding), per-parameter
        values those most of its parameters hold, and the parameters that hold their own
        (:func:`~metadist.strategies.placement.own_states`)."""
        out: dict[str, Any] = {}
        shared: dict[str, dict[str, Any]] = {p.name: {} for p in s.params}
        for state_name in sorted({n for p in s.params for n in names.get(int(p.name), [])}):
            holders = [(p, (name, p.name, state_name)) for p in s.params
                       if state_name in names.get(int(p.name), [])]
            infos = [self.source.tensors.get(key) for _, key in holders]
            if all(info is not None and per_element(state_name, info, p.shape)
                   for info, (p, _) in zip(infos, holders, strict=True)):
                first = infos[0]
                assert first is not None
                buf = torch.zeros(math.prod(s.layout), dtype=first.dtype)
                for p, key in holders:
                    self._info(key, key, p.shape)
                    for part in p.parts:
                        self.source.read(key, part.start, part.stop,
                                         buf[part.offset:part.offset + part.numel])
                out[state_name] = buf.view(s.layout)
                continue
            values = [(p, self.source.full(key) if key in self.source.tensors
                       else self.source.value(key)) for p, key in holders]
            if all(isinstance(v, torch.Tensor) and per_element(state_name, v, p.shape)
                   for p, v in values):  # a 0-dim parameter's, recorded as a value
                buf = torch.zeros(math.prod(s.layout), dtype=values[0][1].dtype)
                for p, v in values:
                    flat = v.reshape(-1)
                    for part in p.parts:
                        buf[part.offset:part.offset + part.numel] = flat[part.start:part.stop]
                out[state_name] = buf.view(s.layout)
                continue
            for p, v in values:  # per parameter (e.g. Adam's step): one value each
                shared[p.name][state_name] = v
        if len(s.params) == 1:
            return {**out, **shared[s.params[0].name]}, {}
        keys = sorted({k for values in shared.values() for k in values})
        common, own = own_states([(p.name, shared[p.name] if names.get(int(p.name)) else None)
                                  for p in s.params], keys)
        return {**out, **common}, own


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


#: keys torch or a scheduler adds to param groups beside an optimizer's hyperparameters
_ADDED_KEYS = frozenset({"params", "initial_lr", "foreach", "fused", "capturable",
                         "differentiable", "maximize", "decoupled_weight_decay"})


def _check_optimizer_class(where: str, optimizer: Optimizer,
                           saved: list[dict[str, Any]]) -> None:
    """Refuse a checkpoint saved from another optimizer class: its param groups carry
    hyperparameters this optimizer does not take (Adam's betas into SGD), and loading would
    give the groups those values and leave state the step cannot read."""
    takes = set(optimizer.defaults) | _ADDED_KEYS
    for i, (group, here) in enumerate(zip(saved, optimizer.param_groups, strict=False)):
        foreign = sorted(set(group) - takes - set(here))
        missing = sorted(set(optimizer.defaults) - set(group) - _ADDED_KEYS)
        if foreign:
            raise CheckpointMismatchError(
                f"{where}: param group {i} in the checkpoint has hyperparameters "
                f"{', '.join(foreign)}, which {type(optimizer).__name__} does not take (it "
                f"takes {', '.join(sorted(set(optimizer.defaults) - _ADDED_KEYS))}"
                f"{'; the checkpoint lacks ' + ', '.join(missing) if missing else ''}): it was "
                "saved from another optimizer class. Build the optimizer the checkpoint was "
                "saved from, or load the model alone and start this optimizer afresh")
