"""What each rank writes into a sharded checkpoint: only what it holds, each tensor once.

* zero3/hsdp modules: for every flat shard, the slices of the parameters that fall in this
  rank's shard; optimizer state the same way (per-element state) or once (scalars).
* zero1/zero2 optimizers: the state of the parameters this rank owns.
* Replicated tensors (ddp parameters, buffers, unsharded optimizer state): written once,
  spread over the ranks so that writes run in parallel: tensors from :data:`SPLIT_BYTES` up
  are cut into one equal range per rank, smaller ones go whole to the least-loaded rank.
  Every rank computes the same assignment from the same tensor order: no communication.
* hsdp shards exist once per replica group: flat ``j`` is written by replica ``j % replicas``.
* Buffers are written by rank 0: ranks may hold different running statistics between ddp's
  broadcasts, and rank 0's are the ones every rank adopts (as in the full format).

Small values (0-dim tensors, numbers), optimizer hyperparameters, stateful objects' states
and plain values are collected here too and written by rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.checkpoint.entries import (
    Entry,
    Key,
    check_plain,
    describe,
    is_piece_tensor,
    plain_copy,
)
from metadist.checkpoint.errors import CheckpointError
from metadist.checkpoint.index import EntryMeta
from metadist.checkpoint.pieces import Slice, TensorInfo
from metadist.comm import ops
from metadist.runtime.world import Group
from metadist.strategies.flat import SCALAR_STATE, FlatLayout
from metadist.strategies.fsdp import ShardedModule
from metadist.strategies.module import DistributedModule
from metadist.strategies.sharded_optim import Sharding
from metadist.strategies.wrap import state_dict_key
from metadist.strategies.zero import OwnerLayout

SPLIT_BYTES = 1 << 20


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state-dict name, buffer) of every buffer a state dict includes."""
    out = []
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out.append((state_dict_key(f"{prefix}.{name}" if prefix else name), b))
    return out


def param_shapes(optimizer: Optimizer) -> list[tuple[int, ...]]:
    """Shapes of the optimizer's parameters in the plain format's order (zero3 replaces
    parameters' data by empty tensors, so their shapes come from the flat slots)."""
    sharding: Sharding | None = getattr(optimizer, "metadist_sharding", None)
    if sharding is None:
        return [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    where = sharding.layout.where if isinstance(sharding.layout, FlatLayout) else {}
    shapes = []
    for p in sharding.original:
        if id(p) in where:
            flat, i = where[id(p)]
            shapes.append(tuple(flat.slots[i].shape))
        else:
            shapes.append(tuple(p.shape))
    return shapes


def hyperparameters(optimizer: Optimizer, counts: list[int]) -> list[dict[str, Any]]:
    """The plain format's param groups: hyperparameters and consecutive parameter indices."""
    groups, start = [], 0
    for group, count in zip(optimizer.param_groups, counts, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + count))})
        start += count
    return groups


def _is_writer(replicate_group: Group, index: int) -> bool:
    _, replicas, replica = ops.group_info(replicate_group)
    return replica == index % replicas


@dataclass
class Capture:
    """One rank's share of a sharded checkpoint (see the module docstring)."""

    rank: int
    world_size: int
    slices: list[Slice] = field(default_factory=list)
    values: dict[Key, Any] = field(default_factory=dict)
    entries: dict[str, EntryMeta] = field(default_factory=dict)
    param_groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)
    plain: dict[str, Any] = field(default_factory=dict)
    _load: list[int] = field(default_factory=list)  # bytes each rank writes of replicas

    def __post_init__(self) -> None:
        self._load = [0] * self.world_size

    def add(self, entry: Entry) -> None:
        match entry.kind:
            case "module":
                self._module(entry.name, entry.value)
            case "optimizer":
                self._optimizer(entry.name, entry.value)
            case "stateful":
                self.entries[entry.name] = EntryMeta("stateful")
                if self.rank == 0:
                    state = entry.value.state_dict()
                    check_plain(state, f"{describe((entry.name,))}.state_dict()")
                    self.stateful[entry.name] = plain_copy(state)
            case "value":
                self.entries[entry.name] = EntryMeta("value")
                if self.rank == 0:
                    self.plain[entry.name] = plain_copy(entry.value)

    # ----- helpers ------------------------------------------------------------------------
    def _value(self, key: Key, value: Any) -> None:
        check_plain(value, describe(key))
        self.values[key] = plain_copy(value)

    def _replicated(self, key: Key, t: torch.Tensor) -> None:
        """A tensor every rank holds: its share of the writes goes to one or all ranks."""
        info = TensorInfo(tuple(t.shape), t.dtype)
        n, nbytes = t.numel(), t.numel() * t.element_size()
        flat = t.detach().reshape(-1)
        if self.world_size > 1 and nbytes >= SPLIT_BYTES:
            for r in range(self.world_size):
                self._load[r] += nbytes // self.world_size
            lo, hi = self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size
            self.slices.append(Slice(key, info, lo, hi, flat[lo:hi]))
            return
        owner = min(range(self.world_size), key=lambda r: (self._load[r], r))
        self._load[owner] += nbytes
        if owner == self.rank:
            self.slices.append(Slice(key, info, 0, n, flat))

    def _from_rank0(self, key: Key, t: torch.Tensor) -> None:
        if self.rank == 0 and is_piece_tensor(t):
            info = TensorInfo(tuple(t.shape), t.dtype)
            self.slices.append(Slice(key, info, 0, t.numel(), t.detach().reshape(-1)))
        elif self.rank == 0:
            self._value(key, t)

    def _shard_slice(self, key: Key, info: TensorInfo, offset: int, lo: int,
                     shard: torch.Tensor) -> None:
        """The part of a parameter at ``offset`` of a flat buffer inside the shard at ``lo``."""
        if info.numel == 0:  # in no shard's range: the first shard records it
            if lo == 0:
                self.slices.append(Slice(key, info, 0, 0, shard[:0]))
            return
        a, b = max(lo, offset), min(lo + shard.numel(), offset + info.numel)
        if a < b:
            self.slices.append(Slice(key, info, a - offset, b - offset, shard[a - lo:b - lo]))

    # ----- modules ------------------------------------------------------------------------
    def _module(self, name: str, module: nn.Module) -> None:
        meta = self.entries[name] = EntryMeta("module")
        if isinstance(module, ShardedModule):
            self._sharded_module(name, module, meta)
            return
        inner = module.module if isinstance(module, DistributedModule) else module
        buffers = {key for key, _ in persistent_buffers(inner)}
        seen: dict[tuple[Any, ...], str] = {}
        for key, value in module.state_dict().items():
            meta.keys.append(key)
            if key in buffers:
                self._from_rank0((name, key), value)
                continue
            if not is_piece_tensor(value):
                if self.rank == 0:
                    self._value((name, key), value)
                continue
            # tied weights appear under several keys: store the first, alias the others
            ident = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride(),
                     value.device) if value.numel() else None
            if ident is not None and ident in seen:
                meta.aliases[key] = seen[ident]
                continue
            if ident is not None:
                seen[ident] = key
            self._replicated((name, key), value)

    def _sharded_module(self, name: str, module: ShardedModule, meta: EntryMeta) -> None:
        for j, flat in enumerate(module.flats):
            writer = _is_writer(flat.replicate_group, j)
            lo = flat.rank * flat.shard_size
            for slot in flat.slots:
                key = state_dict_key(slot.fqn)
                meta.keys.append(key)
                for alias in slot.aliases:
                    meta.keys.append(state_dict_key(alias))
                    meta.aliases[state_dict_key(alias)] = key
                if writer:
                    info = TensorInfo(tuple(slot.shape), flat.shard.dtype)
                    self._shard_slice((name, key), info, slot.offset, lo, flat.shard.detach())
        for key, buf in persistent_buffers(module.module):
            meta.keys.append(key)
            self._from_rank0((name, key), buf)

    # ----- optimizers ---------------------------------------------------------------------
    def _optimizer(self, name: str, optimizer: Optimizer) -> None:
        sharding: Sharding | None = getattr(optimizer, "metadist_sharding", None)
        groups = (sharding.original_groups if sharding is not None
                  else [list(g["params"]) for g in optimizer.param_groups])
        original = [p for g in groups for p in g]
        index = {id(p): i for i, p in enumerate(original)}
        self.entries[name] = EntryMeta("optimizer", shapes=param_shapes(optimizer))
        if self.rank == 0:
            hyper = hyperparameters(optimizer, [len(g) for g in groups])
            check_plain(hyper, f"{describe((name,))} param_groups")
            self.param_groups[name] = plain_copy(hyper)
        layout = sharding.layout if sharding is not None else None
        match layout:
            case None | OwnerLayout():
                owner = layout.owner if isinstance(layout, OwnerLayout) else {}
                for i, p in enumerate(original):
                    state = optimizer.state.get(p)
                    if not state:
                        continue
                    holder = owner.get(p)  # None: every rank holds this state
                    for state_name in sorted(state):
                        key, value = (name, str(i), state_name), state[state_name]
                        if holder is None and is_piece_tensor(value):
                            self._replicated(key, value)
                        elif holder is None and self.rank == 0:
                            self._value(key, value)
                        elif holder == self.rank and is_piece_tensor(value):
                            info = TensorInfo(tuple(value.shape), value.dtype)
                            self.slices.append(Slice(key, info, 0, value.numel(),
                                                     value.detach().reshape(-1)))
                        elif holder == self.rank:
                            self._value(key, value)
            case FlatLayout():
                for j, flat in enumerate(layout.flats):
                    state = optimizer.state.get(flat.shard)
                    if not state or not _is_writer(flat.replicate_group, j):
                        continue
                    lo = flat.rank * flat.shard_size
                    for state_name in sorted(state):
                        value = state[state_name]
                        per_element = (state_name not in SCALAR_STATE and torch.is_tensor(value)
                                       and value.shape == flat.shard.shape)
                        for slot, p in zip(flat.slots, flat.originals, strict=True):
                            key = (name, str(index[id(p)]), state_name)
                            if per_element:
                                info = TensorInfo(tuple(slot.shape), value.dtype)
                                self._shard_slice(key, info, slot.offset, lo, value.detach())
                            elif flat.rank == 0:  # the same on every shard: one writes it
                                self._value(key, value)
            case _:
                raise CheckpointError(
                    f"{describe((name,))} is sharded with a layout metadist cannot checkpoint "
                    f"({type(layout).__name__}); save strategy.optimizer_state_dict(optimizer) "
                    "as a plain value instead")


def capture(entries: list[Entry], rank: int, world_size: int) -> Capture:
    """This rank's share of a sharded checkpoint of ``entries``."""
    out = Capture(rank, world_size)
    for entry in entries:
        out.add(entry)
    return out
