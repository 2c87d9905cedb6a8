"""What each rank writes into a sharded checkpoint: only what it holds, each tensor once.

* zero3/hsdp modules: for every flat shard, the slices of the parameters that fall in this
  rank's shard; optimizer state the same way (per-element state) or once (scalars).
* zero1/zero2 optimizers: the state of the parameters this rank owns.
* Replicated tensors (ddp parameters, buffers, unsharded optimizer state): written once,
  spread over the ranks so that writes run in parallel: tensors from :data:`SPLIT_BYTES` up
  are cut into one equal range per rank, smaller ones go whole to the least-loaded rank.
  Every rank computes the same assignment from the same tensor order: no communication.
* hsdp shards exist once per replica group: flat ``j`` is written by replica ``j % replicas``.
* Replicas must be equal: every rank checksums every replicated tensor, and rank 0 refuses
  the commit where two ranks' differ (the ranks' training diverged; a checkpoint would hold
  pieces of different replicas).
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
from metadist.checkpoint.index import EntryMeta
from metadist.checkpoint.pieces import Slice, TensorInfo, checksum
from metadist.strategies.module import DistributedModule
from metadist.strategies.placement import (
    ModulePlacement,
    Placement,
    held,
    numbered_groups,
    optimizer_placement,
    per_element,
    replicated_module,
    whole_tensor,
)

SPLIT_BYTES = 1 << 20


def module_placement(module: nn.Module) -> ModulePlacement:
    """What the strategy says about a module; any other module (e.g. ``torch.compile``'s
    wrapper of a set-up one) is read and loaded through its state dict."""
    if isinstance(module, DistributedModule):
        return module.placements()
    return replicated_module(module)


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
    #: every replicated tensor's checksum on this rank: the ranks' replicas must be equal,
    #: or the checkpoint would hold pieces of different ones (compared before the commit)
    replicas: dict[Key, int] = field(default_factory=dict)
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

    def _replicated(self, key: Key, info: TensorInfo, flat: torch.Tensor) -> None:
        """A tensor every rank holds: its share of the writes goes to one or all ranks."""
        n, nbytes = info.numel, info.numel * flat.element_size()
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

    def _tensor(self, key: Key, placement: Placement) -> None:
        """Write this rank's share of ``placement`` (see :data:`~metadist.strategies.
        placement.Writer`)."""
        info = TensorInfo(placement.shape, placement.dtype)
        match placement.writer:
            case "spread":
                flat = held(placement.parts[0])
                if self.world_size > 1:
                    self.replicas[key] = checksum(flat)
                self._replicated(key, info, flat)
            case "rank0" if self.rank == 0:
                self.slices.append(Slice(key, info, 0, info.numel, held(placement.parts[0])))
            case "holder":
                self.slices.extend(Slice(key, info, p.start, p.stop, held(p))
                                   for p in placement.parts)

    # ----- modules ------------------------------------------------------------------------
    def _module(self, name: str, module: nn.Module) -> None:
        meta = self.entries[name] = EntryMeta("module")
        where = module_placement(module)
        meta.keys.extend(where.keys)
        meta.aliases.update(where.aliases)
        for placement in where.tensors:
            self._tensor((name, placement.name), placement)
        if self.rank == 0:
            for key, value in where.values.items():
                self._value((name, key), value)

    # ----- optimizers ---------------------------------------------------------------------
    def _optimizer(self, name: str, optimizer: Optimizer) -> None:
        where = optimizer_placement(optimizer)
        self.entries[name] = EntryMeta("optimizer", shapes=list(where.shapes))
        if self.rank == 0:
            hyper = numbered_groups(optimizer.param_groups, where.counts)
            check_plain(hyper, f"{describe((name,))} param_groups")
            self.param_groups[name] = plain_copy(hyper)
        for s in where.stepped:
            state = optimizer.state.get(s.tensor)
            if not state:
                continue
            for p in s.params:
                held_state = s.state_for(p, state) or {}  # one process's, for p
                for state_name in sorted(held_state):
                    value = held_state[state_name]
                    key = (name, p.name, state_name)
                    if is_piece_tensor(value) and per_element(state_name, value, s.layout):
                        self._tensor(key, p.on(value))
                    elif is_piece_tensor(value) and p.whole() is not None:
                        # per parameter, yet a tensor: stored whole, as the parameter is held
                        self._tensor(key, whole_tensor(p.name, value, p.writer))
                    elif s.lead:
                        self._value(key, value)


def capture(entries: list[Entry], rank: int, world_size: int) -> Capture:
    """This rank's share of a sharded checkpoint of ``entries``."""
    out = Capture(rank, world_size)
    for entry in entries:
        out.add(entry)
    return out
