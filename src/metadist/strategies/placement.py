"""Where each tensor of a set-up model and of its optimizer's state lives on this rank.

Every strategy describes its layout with these records (``DistributedModule.placements()``,
``OptimizerLayout.placements(...)``), and whatever moves whole tensors in or out of a
strategy (checkpoint save, load and consolidation, optimizer-state consolidation, the meta
layer's gradient landing, zero3's state dicts) reads only the description. A tensor is named
by its state-dict key (parameters, tied aliases, persistent buffers) or by the optimizer's
plain-format parameter index; its elements are counted in the flattened global tensor.

* A :class:`Part` is a contiguous range of those elements held in a local tensor: a whole
  replicated parameter, or the slice of a parameter inside a zero3 flat shard.
* A :class:`Placement` is one global tensor: name, shape, dtype, the parts this rank holds
  and who writes it when saving (:data:`Writer`).
* :class:`ModulePlacement` and :class:`OptimizerPlacement` collect them for a module's state
  dict and an optimizer's state.

:func:`held` and :func:`paste` are the only code that maps a global range onto a local one.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.comm import ops
from metadist.runtime.world import Group
from metadist.strategies.zero3.wrap import state_dict_key

if TYPE_CHECKING:
    from metadist.strategies.zero3.flat import FlatParam

#: Who writes a tensor when saving:
#: ``"spread"``: every rank holds it whole and identical, so the writes may be spread over
#: the ranks; ``"rank0"``: every rank holds it whole but only rank 0's copy counts (buffers,
#: whose running statistics may differ between ddp's broadcasts); ``"holder"``: this rank
#: writes the parts it holds, which no other rank writes; ``"none"``: another rank writes
#: them (hsdp: one replica group per shard).
Writer = Literal["spread", "rank0", "holder", "none"]

# Optimizer state kept per parameter, not per element (torch.optim's counters).
PER_PARAMETER_STATE = frozenset({"step", "mu_product", "eta", "mu"})


@dataclass(frozen=True, eq=False)
class Part:
    """Elements ``[start, stop)`` of a flattened global tensor, held in ``local`` (read as
    1-D) from element ``offset`` on."""

    start: int
    stop: int
    local: torch.Tensor
    offset: int = 0

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def on(self, local: torch.Tensor) -> Part:
        """The same range in another local tensor laid out like this one (optimizer state
        shaped like the tensor it steps)."""
        return Part(self.start, self.stop, local, self.offset)


@dataclass(frozen=True, eq=False)
class Placement:
    """One global tensor and the parts of it this rank holds."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[Part, ...]
    writer: Writer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def on(self, local: torch.Tensor) -> Placement:
        """This placement with every part held in ``local`` instead (see :meth:`Part.on`)."""
        return Placement(self.name, self.shape, local.dtype,
                         tuple(p.on(local) for p in self.parts), self.writer)

    def whole(self) -> torch.Tensor | None:
        """The local tensor holding all of it in its own shape, if one does (replicated)."""
        if len(self.parts) != 1:
            return None
        part = self.parts[0]
        local = part.local
        if (part.start, part.stop, part.offset) == (0, self.numel, 0) and (
                tuple(local.shape) == self.shape):
            return local
        return None


def held(part: Part) -> torch.Tensor:
    """The part's elements of ``part.local`` (detached), 1-D: a view, except of a whole
    tensor in a non-contiguous layout, whose copy is only for reading."""
    return part.local.detach().reshape(-1)[part.offset:part.offset + part.numel]


def paste(part: Part, data: torch.Tensor) -> None:
    """Copy ``data`` (the part's ``numel`` elements, any shape) into the part's place."""
    with torch.no_grad():
        if not part.local.is_contiguous():  # a whole replicated tensor in another layout
            part.local.detach().copy_(data.reshape(part.local.shape))
        else:
            held(part).copy_(data.reshape(-1))


def flat_part(local: torch.Tensor, lo: int, offset: int, numel: int) -> tuple[Part, ...]:
    """The part of a tensor at ``offset`` of a flat buffer (``numel`` elements) that falls in
    ``local``, the slice of that buffer starting at ``lo``. An empty tensor lies in no slice:
    the one at 0 records it, so that it still has exactly one writer."""
    if numel == 0:
        return (Part(0, 0, local, 0),) if lo == 0 else ()
    a, b = max(lo, offset), min(lo + local.numel(), offset + numel)
    return (Part(a - offset, b - offset, local, a - lo),) if a < b else ()


def per_element(name: str, value: Any, shape: Sequence[int]) -> bool:
    """Whether optimizer state ``name`` holds one value per element of a tensor of ``shape``
    (Adam's moments), rather than one per parameter (its step count). ``value``: the state,
    or what a checkpoint records of it (anything with its ``shape``)."""
    value_shape = getattr(value, "shape", None)
    return (name not in PER_PARAMETER_STATE and value_shape is not None
            and tuple(value_shape) == tuple(shape))


def numbered_groups(groups: Sequence[Mapping[str, Any]], counts: Sequence[int]
                    ) -> list[dict[str, Any]]:
    """Param groups in the plain state-dict format: each group's hyperparameters and the
    consecutive indices of its ``counts[k]`` parameters."""
    out, start = [], 0
    for group, count in zip(groups, counts, strict=True):
        out.append({**{k: v for k, v in group.items() if k != "params"},
                    "params": list(range(start, start + count))})
        start += count
    return out


def is_writer(replicate_group: Group, index: int) -> bool:
    """hsdp: whether this rank's replica group writes shard ``index`` (one replica each)."""
    _, replicas, replica = ops.group_info(replicate_group)
    return replica == index % replicas


# ----- modules -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ModulePlacement:
    """A module's state dict as this rank holds it."""

    #: every state-dict key, in the state dict's order, tied aliases included
    keys: tuple[str, ...]
    #: tied names -> the name their tensor is described (and stored) under
    aliases: Mapping[str, str]
    #: the tensors of one or more dimensions, each once
    tensors: tuple[Placement, ...]
    #: everything else (0-dim tensors, extra state), held whole by every rank; rank 0 writes it
    values: Mapping[str, Any]
    #: state-dict keys a checkpoint may hold that are not loaded (non-persistent buffers)
    ignorable: frozenset[str]
    #: loads new contents: per tensor name, its parts' elements (in ``parts`` order); values
    load: Callable[[Mapping[str, list[torch.Tensor]], Mapping[str, Any]], None]
    #: the user's module holds every parameter whole itself (not a strategy's flat shards)
    in_module: bool = True
    #: to call with the names of parameters whose gradients are about to be added into the
    #: stepped tensors outside a backward (zero3 records which parameters have a gradient,
    #: strategies/zero3/unreached.py); nothing to do where every parameter is a tensor of its own
    gradients_added: Callable[[Iterable[str]], None] = lambda names: None
    _by_name: dict[str, Placement] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {p.name: p for p in self.tensors})

    def find(self, name: str) -> Placement | None:
        """The tensor called ``name`` (a state-dict key, a tied alias or a parameter's
        module path)."""
        key = state_dict_key(name)
        return self._by_name.get(self.aliases.get(key, key))


def non_persistent(module: nn.Module) -> frozenset[str]:
    return frozenset(state_dict_key(f"{prefix}.{n}" if prefix else n)
                     for prefix, m in module.named_modules()
                     for n in m._non_persistent_buffers_set)


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state-dict name, buffer) of every buffer a state dict includes."""
    out = []
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out.append((state_dict_key(f"{prefix}.{name}" if prefix else name), b))
    return out


def _is_piece(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def whole_tensor(name: str, t: torch.Tensor, writer: Writer) -> Placement:
    """``t`` held whole by this rank."""
    return Placement(name, tuple(t.shape), t.dtype, (Part(0, t.numel(), t, 0),), writer)


def replicated_module(module: nn.Module, inner: nn.Module | None = None, *,
                      keep_vars: bool = False) -> ModulePlacement:
    """Every rank holds ``module``'s whole state dict (its parameters identical: writes
    spread; its buffers: rank 0's). Loads through ``module.load_state_dict``. ``inner``: the
    user's module whose buffers and non-persistent buffers are meant (default ``module``);
    ``keep_vars``: parts are the parameters themselves (the state dict holds them)."""
    inner = module if inner is None else inner
    buffers = {key for key, _ in persistent_buffers(inner)}
    keys: list[str] = []
    aliases: dict[str, str] = {}
    tensors: list[Placement] = []
    values: dict[str, Any] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for key, value in module.state_dict(keep_vars=keep_vars).items():
        keys.append(key)
        if not _is_piece(value):
            values[key] = value
            continue
        if key in buffers:
            tensors.append(whole_tensor(key, value, "rank0"))
            continue
        # tied weights appear under several keys: described once, the others are aliases
        ident = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride(),
                 value.device) if value.numel() else None
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        tensors.append(whole_tensor(key, value, "spread"))
    shapes = {p.name: p.shape for p in tensors}

    def load(parts: Mapping[str, list[torch.Tensor]], new_values: Mapping[str, Any]) -> None:
        new: OrderedDict[str, Any] = OrderedDict()
        for key in keys:
            stored = aliases.get(key, key)
            new[key] = (parts[stored][0].view(shapes[stored]) if stored in parts
                        else new_values[key])
        module.load_state_dict(new)

    return ModulePlacement(tuple(keys), aliases, tuple(tensors), values,
                           non_persistent(inner), load)


def flat_module(module: nn.Module, flats: Sequence[FlatParam],
                after_load: Callable[[], None]) -> ModulePlacement:
    """zero3/hsdp: each parameter's slice of its flat's shard on this rank (flat ``j`` is
    written by replica group ``j % replicas``), buffers whole. Loading writes the shards
    (their padding zeroed) and the buffers, then ``after_load()``."""
    keys: list[str] = []
    aliases: dict[str, str] = {}
    tensors: list[Placement] = []
    for j, flat in enumerate(flats):
        writer: Writer = "holder" if is_writer(flat.replicate_group, j) else "none"
        shard = flat.shard
        for slot in flat.slots:
            key = state_dict_key(slot.fqn)
            keys.append(key)
            for alias in slot.aliases:
                keys.append(state_dict_key(alias))
                aliases[state_dict_key(alias)] = key
            parts = flat_part(shard, flat.rank * flat.shard_size, slot.offset, slot.numel)
            tensors.append(Placement(key, tuple(slot.shape), shard.dtype, parts, writer))
    values: dict[str, Any] = {}
    for key, buf in persistent_buffers(module):
        keys.append(key)
        if _is_piece(buf):
            tensors.append(whole_tensor(key, buf, "rank0"))
        else:
            values[key] = buf

    def load(parts: Mapping[str, list[torch.Tensor]], new_values: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for flat in flats:
                flat.shard.zero_()
            for placement in tensors:
                for part, data in zip(placement.parts, parts[placement.name], strict=True):
                    paste(part, data)
            for key, value in new_values.items():
                values[key].copy_(value)
        after_load()  # drop gathered copies of the old parameters

    def gradients_added(names: Iterable[str]) -> None:
        given = set(names)
        for flat in flats:
            mask = [slot.fqn in given or state_dict_key(slot.fqn) in given
                    for slot in flat.slots]
            if flat.shard.requires_grad and any(mask):
                flat.gradient_added(mask)

    return ModulePlacement(tuple(keys), aliases, tuple(tensors), values, non_persistent(module),
                           load, in_module=False, gradients_added=gradients_added)


# ----- optimizers ----------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Stepped:
    """A tensor this rank's optimizer steps and the original parameters it holds parts of:
    their per-element state is laid out in its state tensors as they are in it."""

    tensor: torch.Tensor
    #: per original parameter whose state lives in this tensor's: named by its index, its
    #: parts in ``tensor`` (none when all its elements are on other ranks)
    params: tuple[Placement, ...]
    #: this rank writes the per-parameter values (step counts) of these parameters
    lead: bool
    #: parameters (by name) whose state one process holds otherwise than this tensor's:
    #: their own per-parameter values, or None for no state at all (zero3: parameters a
    #: step skipped, strategies/zero3/unreached.py)
    own: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    #: the shape its per-element state has where that is not the tensor's (a zero3/hsdp
    #: parameter stepped as it is: its slice, strategies/zero3/sharded_param.py)
    state_shape: tuple[int, ...] | None = None

    @property
    def layout(self) -> tuple[int, ...]:
        """The shape of this tensor's per-element state."""
        return self.state_shape if self.state_shape is not None else tuple(self.tensor.shape)

    def state_for(self, p: Placement, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """What one process's optimizer state holds for parameter ``p``, given this
        tensor's ``state``: its per-element entries, per-parameter values (its own where
        they differ), None if it holds none."""
        if p.name not in self.own:
            return dict(state)
        own = self.own[p.name]
        if own is None:
            return None
        return {**{k: v for k, v in state.items() if per_element(k, v, self.layout)},
                **own}


@dataclass(frozen=True, eq=False)
class OptimizerPlacement:
    """An optimizer's state as this rank holds it, indexed as in the plain format."""

    #: every original parameter's global shape
    shapes: tuple[tuple[int, ...], ...]
    #: original parameters per param group
    counts: tuple[int, ...]
    #: the tensors the optimizer steps here, in its param groups' order
    stepped: tuple[Stepped, ...]
    #: entries a local (this rank's) state dict carries, e.g. the layout's tag
    tag: Mapping[str, Any] = field(default_factory=dict)


def _sliced(name: str, p: Any) -> Stepped:
    """A zero3/hsdp parameter an unsharded optimizer steps as it is (built over
    ``model.parameters()`` after setup): its state is its slice's, laid out as that slice
    (strategies/zero3/sharded_param.py); replica group 0 writes it."""
    flat, index = p.source
    slot = flat.slots[index]
    local = p.to_local()
    lo = flat.rank * flat.shard_size
    begin = lo + min(max(slot.offset - lo, 0), flat.shard_size)  # the slice's first element
    writer: Writer = "holder" if is_writer(flat.replicate_group, 0) else "none"
    parts = flat_part(local, begin, slot.offset, slot.numel)
    return Stepped(p, (Placement(name, tuple(slot.shape), p.dtype, parts, writer),),
                   writer == "holder" and flat.rank == 0, state_shape=tuple(local.shape))


def replicated_optimizer(optimizer: Optimizer) -> OptimizerPlacement:
    """An optimizer every rank holds whole (parameters identical: writes spread, values
    written by rank 0); zero3/hsdp parameters stepped as they are hold their slices'."""
    groups = [list(g["params"]) for g in optimizer.param_groups]
    rank = ops.group_info(None)[2]
    stepped = tuple(_sliced(str(i), p) if getattr(p, "source", None) is not None
                    and hasattr(p, "to_local")
                    else Stepped(p, (whole_tensor(str(i), p, "spread"),), rank == 0)
                    for i, p in enumerate(p for g in groups for p in g))
    return OptimizerPlacement(tuple(tuple(p.shape) for g in groups for p in g),
                              tuple(len(g) for g in groups), stepped)


def optimizer_placement(optimizer: Optimizer) -> OptimizerPlacement:
    """The description of any optimizer, sharded by a strategy or not."""
    sharding = getattr(optimizer, "metadist_sharding", None)
    if sharding is None:
        return replicated_optimizer(optimizer)
    out: OptimizerPlacement = sharding.placements()
    return out


def flat_optimizer(flats: Sequence[FlatParam], original_groups: Sequence[Sequence[torch.Tensor]],
                   stepped: Sequence[torch.Tensor]) -> OptimizerPlacement:
    """zero3/hsdp: each flat's shard (``stepped``: those this rank's optimizer steps, in its
    order) holds its parameters' slices; its per-parameter values are written once, by its
    first rank in the writing replica group. Shapes come from the flats' slots (zero3
    empties the original parameters' data)."""
    original = [p for g in original_groups for p in g]
    index = {id(p): i for i, p in enumerate(original)}
    shapes = {id(p): tuple(slot.shape) for flat in flats
              for slot, p in zip(flat.slots, flat.originals, strict=True)}
    of_shard = {id(flat.shard): (j, flat) for j, flat in enumerate(flats)}
    out = []
    for t in stepped:
        j, flat = of_shard[id(t)]
        writer: Writer = "holder" if is_writer(flat.replicate_group, j) else "none"
        lo = flat.rank * flat.shard_size
        shard = flat.shard
        params = tuple(
            Placement(str(index[id(p)]), tuple(slot.shape), shard.dtype,
                      flat_part(shard, lo, slot.offset, slot.numel), writer)
            for slot, p in zip(flat.slots, flat.originals, strict=True))
        own = {params[i].name: value for i, value in flat.skipped.items()}
        out.append(Stepped(flat.shard, params, writer == "holder" and flat.rank == 0, own))
    return OptimizerPlacement(tuple(shapes.get(id(p), tuple(p.shape)) for p in original),
                              tuple(len(g) for g in original_groups), tuple(out))
