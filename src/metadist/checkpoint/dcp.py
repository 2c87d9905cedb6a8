"""torch's distributed checkpoint (``torch.distributed.checkpoint``, DCP) over metadist's state.

``model_sd, optim_sd = get_state_dict(model, optimizer)`` gives state dicts in the format of
torch's own ``torch.distributed.checkpoint.state_dict.get_state_dict`` (the user's parameter
and buffer names; the optimizer's state keyed by parameter name), whose tensors describe
where their elements are on this rank. ``dcp.save({"model": model_sd, "optim": optim_sd},
checkpoint_id=path)`` writes each element once; ``dcp.load`` of the same dicts reads into
this rank's tensors, and ``set_state_dict(model, optimizer, model_state_dict=...,
optim_state_dict=...)`` completes the load. A checkpoint written so is read by one process
(``get_state_dict`` on the plain model), by FSDP2 or by any metadist strategy and world size.

[Note: element ranges as boxes]
DCP describes what a rank holds of a tensor as n-dimensional boxes (offsets, sizes). A
zero3/hsdp shard holds a contiguous range of each parameter's flattened elements; a range of
a row-major tensor is at most ``2 * ndim - 1`` boxes (a partial first row, whole rows, a
partial last row, recursively), each contiguous in memory: :func:`boxes`. Every strategy's
description of its state (strategies/placement.py) becomes boxes this way, so one adapter
serves replicated, owned and sharded state alike.

Writes follow the description's writer: a replicated tensor is offered by every rank (DCP
keeps one), buffers by rank 0 (as metadist's own formats: ranks' running statistics may
differ), a shard's range by the rank (replica group, under hsdp) that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.optim import Optimizer

from metadist.checkpoint.capture import module_placement
from metadist.comm import ops
from metadist.strategies.own_state import OWN, own_states
from metadist.strategies.placement import (
    ModulePlacement,
    Placement,
    Stepped,
    held,
    numbered_groups,
    optimizer_placement,
    per_element,
)
from metadist.strategies.zero3.wrap import state_dict_key


@dataclass(frozen=True)
class Box:
    """Elements ``[start, start + prod(sizes))`` of the flattened tensor: the box at
    ``offsets`` of ``sizes``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes covering elements ``[start, stop)`` of a row-major tensor of ``shape``
    ([Note: element ranges as boxes])."""
    if start >= stop:
        return []
    if not shape:
        return [Box((), (), start)]
    inner = math.prod(shape[1:])
    out: list[Box] = []

    def rows_of(row: int, lo: int, hi: int) -> None:  # [lo, hi) inside one row
        base = row * inner
        out.extend(Box((row, *b.offsets), (1, *b.sizes), base + b.start)
                   for b in boxes(shape[1:], lo - base, hi - base))

    if start % inner:
        head = min(stop, (start // inner + 1) * inner)
        rows_of(start // inner, start, head)
        start = head
    whole = (stop - start) // inner
    if whole:
        out.append(Box((start // inner, *[0] * (len(shape) - 1)), (whole, *shape[1:]), start))
        start += whole * inner
    if start < stop:
        rows_of(start // inner, start, stop)
    return out


class PlacedTensor(torch.Tensor):
    """A tensor of global shape, with no storage of its own (as DTensor's wrapper), whose
    elements this rank holds as a :class:`~metadist.strategies.placement.Placement`
    describes: DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``) reads and writes them there, box
    by box. It is a description for DCP, not values to compute with."""

    placement: Placement
    writes: bool

    @staticmethod
    def __new__(cls, placement: Placement, writes: bool) -> PlacedTensor:
        device = placement.parts[0].local.device if placement.parts else torch.device("cpu")
        out = torch.Tensor._make_wrapper_subclass(cls, placement.shape, dtype=placement.dtype,
                                                  device=device)
        out.placement, out.writes = placement, writes
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        raise RuntimeError(
            f"{func} read a DCP state-dict entry of metadist.checkpoint.dcp.get_state_dict, "
            "which describes where this rank holds a tensor's elements for "
            "torch.distributed.checkpoint and has no values of its own; read values from "
            "the model and optimizer (or model.full_parameters())")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return (f"PlacedTensor({self.placement.name!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, parts={[(p.start, p.stop) for p in self.placement.parts]})")

    def _views(self) -> Iterator[tuple[Box, torch.Tensor]]:
        shape = self.placement.shape
        for part in self.placement.parts:
            if part.numel == 0 and math.prod(shape) == 0:  # an empty tensor: one empty box
                yield Box((0,) * len(shape), shape, 0), held(part).view(shape)
                continue
            data = held(part)
            for box in boxes(shape, part.start, part.stop):
                lo = box.start - part.start
                yield box, data[lo:lo + math.prod(box.sizes)].view(box.sizes)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if not self.writes:
            return []
        size = torch.Size(self.placement.shape)
        return [WriteItem(
            index=MetadataIndex(fqn, torch.Size(box.offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)),
                properties=TensorProperties.create_from_tensor(view), size=size))
            for box, view in self._views()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes))
                for box, _ in self._views()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else None
        for box, view in self._views():
            if box.offsets == offsets:
                return view
        raise ValueError(f"this rank holds no part of {index.fqn!r} at {offsets}")


def _writes(placement: Placement, rank: int) -> bool:
    return placement.writer in ("holder", "spread") or (placement.writer == "rank0"
                                                       and rank == 0)


def _placed(placement: Placement) -> PlacedTensor:
    return PlacedTensor(placement, _writes(placement, ops.group_info(None)[2]))


# ----- models --------------------------------------------------------------------------------
def _model_state(where: ModulePlacement) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in where.keys:
        if key in where.ignorable:
            continue
        found = where.find(key)
        if found is not None:
            out[key] = _placed(found)
        elif key in where.values:
            out[key] = where.values[key]
    return out


def get_model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict for DCP (module notes), keyed as one process's
    ``model.state_dict()`` of the user's module."""
    return _model_state(module_placement(model))


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Complete a ``dcp.load`` into :func:`get_model_state_dict`'s dict: the strategy takes
    the loaded tensors (zero3/hsdp drop gathered copies of the old values) and the values
    DCP replaced in the dict."""
    where = module_placement(model)
    parts = {p.name: [held(part).clone() for part in p.parts] for p in where.tensors}
    values = {k: state_dict[k] for k in where.values if k in state_dict}
    where.load(parts, values)


# ----- optimizers ----------------------------------------------------------------------------
def _names(model: nn.Module) -> dict[int, str]:
    """Each parameter object a set-up optimizer may hold -> its state-dict name."""
    inner = getattr(model, "module", model)
    out = {id(p): state_dict_key(n) for n, p in inner.named_parameters(remove_duplicate=False)}
    for flat in getattr(model, "flats", ()):
        for slot, p in zip(flat.slots, flat.originals, strict=True):
            out.setdefault(id(p), state_dict_key(slot.fqn))
    return out


def _originals(optimizer: Optimizer) -> list[torch.Tensor]:
    sharding = getattr(optimizer, "metadist_sharding", None)
    groups = (sharding.original_groups if sharding is not None
              else [g["params"] for g in optimizer.param_groups])
    return [p for g in groups for p in g]


def _param_names(model: nn.Module, optimizer: Optimizer) -> list[str]:
    names = _names(model)
    out = []
    for i, p in enumerate(_originals(optimizer)):
        if id(p) not in names:
            raise ValueError(
                f"parameter {i} of the optimizer ({type(optimizer).__name__}) is not one of "
                "the model's parameters, and DCP keys optimizer state by parameter name; "
                "build the optimizer over the set-up model's parameters")
        out.append(names[id(p)])
    return out


def _init_state(optimizer: Optimizer) -> None:
    """Create a fresh optimizer's state, so that a load has tensors to read into: one step
    of its own (no strategy hooks: no collective, nothing counted) with zero gradients and
    learning rate 0, as torch's ``get_state_dict`` does for one process."""
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or any(p.grad is not None for p in tensors):
        return
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for p in tensors:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        step = type(optimizer).step
        getattr(step, "__wrapped__", step)(optimizer)
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p in tensors:
            p.grad = None


def _stepped_state(optimizer: Optimizer, s: Stepped) -> Iterator[tuple[Placement, dict[str, Any]]]:
    state = optimizer.state.get(s.tensor) or {}
    for p in s.params:
        yield p, s.state_for(p, state) or {}


def get_optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state dict for DCP, as torch's ``get_optimizer_state_dict`` of one
    process: ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``.
    Per-element state describes where this rank holds it; per-parameter values (a step
    count) are copies. A fresh optimizer's state is created first (:func:`_init_state`)."""
    _init_state(optimizer)
    where = optimizer_placement(optimizer)
    names = _param_names(model, optimizer)
    state: dict[str, dict[str, Any]] = {}
    for s in where.stepped:
        for p, entry in _stepped_state(optimizer, s):
            out = state.setdefault(names[int(p.name)], {})
            for k, v in entry.items():
                if per_element(k, v, s.layout):
                    out[k] = _placed(p.on(v))
                else:
                    out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    groups = numbered_groups(optimizer.param_groups, where.counts)
    for g in groups:
        g["params"] = [names[i] for i in g["params"]]
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(model: nn.Module, optimizer: Optimizer,
                             state_dict: Mapping[str, Any]) -> None:
    """Complete a ``dcp.load`` into :func:`get_optimizer_state_dict`'s dict: per-element
    state was read in place; per-parameter values and hyperparameters go in through the
    optimizer's ``load_state_dict`` (a stepped tensor's parameters may hold their own)."""
    where = optimizer_placement(optimizer)
    names = _param_names(model, optimizer)
    loaded: Mapping[str, Mapping[str, Any]] = state_dict["state"]
    state: dict[int, dict[str, Any]] = {}
    owns: dict[int, Any] = {}
    for j, s in enumerate(where.stepped):
        live = optimizer.state.get(s.tensor) or {}
        out = {k: v for k, v in live.items() if per_element(k, v, s.layout)}
        shared = {p.name: {k: v for k, v in loaded.get(names[int(p.name)], {}).items()
                           if not isinstance(v, PlacedTensor)} for p in s.params}
        if len(s.params) == 1:
            out.update(shared[s.params[0].name])
        else:
            keys = sorted({k for values in shared.values() for k in values})
            common, owns[j] = own_states([(n, v or None) for n, v in shared.items()], keys)
            out.update(common)
        if out:
            state[j] = out
    saved = state_dict["param_groups"]
    if [len(g["params"]) for g in saved] != list(where.counts):
        raise ValueError(
            f"the loaded param groups hold {[len(g['params']) for g in saved]} parameters, "
            f"this optimizer's {list(where.counts)}; build the optimizer over the same "
            "parameters in the same groups as the one saved")
    groups = numbered_groups(saved, [len(g["params"]) for g in optimizer.param_groups])
    optimizer.load_state_dict({"state": state, "param_groups": groups, **where.tag,
                               **({OWN: {j: o for j, o in owns.items() if o}}
                                  if where.tag else {})})


def get_state_dict(model: nn.Module, optimizer: Optimizer | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model state dict, optimizer state dict)`` for DCP (module notes); the second is
    empty without an optimizer."""
    return (get_model_state_dict(model),
            get_optimizer_state_dict(model, optimizer) if optimizer is not None else {})


def set_state_dict(model: nn.Module, optimizer: Optimizer | None = None, *,
                   model_state_dict: Mapping[str, Any],
                   optim_state_dict: Mapping[str, Any] | None = None) -> None:
    """Complete a ``dcp.load`` into :func:`get_state_dict`'s dicts."""
    set_model_state_dict(model, model_state_dict)
    if optimizer is not None:
        if optim_state_dict is None:
            raise ValueError("set_state_dict was given an optimizer but no optim_state_dict; "
                             "pass the optimizer dict dcp.load read into")
        set_optimizer_state_dict(model, optimizer, optim_state_dict)
