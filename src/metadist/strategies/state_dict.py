"""State dicts of a zero3/hsdp model that behave like the plain module's.

Between forwards the user's modules hold placeholders in place of their parameters (the
values are slices of flat shards, strategies/zero3/flat.py), which torch's ``state_dict`` writes
in their places and ``load_state_dict`` cannot copy into. Hooks on every module of the
user's tree write the values in those places and load the shards instead, so
``model.state_dict()``, ``model.module.state_dict()``, a submodule's, and that of a module
the set-up model sits in (``torch.compile(model)`` included) give the plain module's keys,
in its order: ``prefix``, ``destination`` and ``keep_vars`` honoured, buffers written by
torch itself (non-persistent ones left out). Loading reports missing and unexpected keys
and size mismatches as torch does.

Saving is a collective (every rank calls it): each flat is all-gathered once per call, in
the shard's dtype, and its parameters are returned as copies (with ``keep_vars=True``:
gathered tensors that gradients flow through back to the shards, as
``model.full_parameters()``'s). Loading needs no communication: each rank copies its slice
of every parameter from the full values it is given, so every rank passes the same dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from metadist.comm import alone
from metadist.strategies.placement import flat_part, paste
from metadist.strategies.zero3.flat import FlatParam
from metadist.strategies.zero3.sharded_param import ShardedParam, resolved

FlatRef = tuple[str, FlatParam, int]  # (attribute, flat, slot index)


def parameter_order(root: nn.Module) -> dict[nn.Module, list[str]]:
    """Each module's parameter names in registration order: a state dict lists a module's
    parameters in this order."""
    return {m: list(m._parameters) for m in root.modules()}


class ShardedStateDict:
    """The state-dict hooks of one zero3/hsdp model's user modules."""

    def __init__(self, root: nn.Module, flats: Sequence[FlatParam],
                 order: Mapping[nn.Module, Sequence[str]], on_load: Callable[[], None]) -> None:
        self.own: dict[nn.Module, list[FlatRef]] = {}
        for flat in flats:
            for i, slot in enumerate(flat.slots):
                for module, attr in slot.uses:
                    self.own.setdefault(module, []).append((attr, flat, i))
        for module, entries in self.own.items():
            names = list(order.get(module, ()))
            entries.sort(key=lambda e: names.index(e[0]) if e[0] in names else len(names))
        self._tree = set(root.modules())
        self._on_load = on_load
        #: (module, keep_vars) of the state_dict calls running, outermost first
        self._open: list[tuple[nn.Module, bool]] = []
        self._values: dict[tuple[FlatParam, int], torch.Tensor] = {}
        self._read_at: dict[FlatParam, int] = {}  # the shard version _values were read at

        # Plain functions, not bound methods: a deepcopy of a module (plain_module) copies
        # its hooks, and must not copy this object with them. On a copy they do nothing.
        def enter(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            self._enter(module, keep_vars)

        def leave(module: nn.Module, destination: MutableMapping[str, Any], prefix: str,
                  local_metadata: Any) -> None:
            self._leave(module, destination, prefix)

        def load(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: dict[str, Any], strict: bool, missing: list[str],
                 unexpected: list[str], error_msgs: list[str]) -> None:
            self._load(module, state_dict, prefix, local_metadata, error_msgs)

        def loaded(module: nn.Module, incompatible: Any) -> None:
            self._loaded(module, incompatible.missing_keys)

        self.handles = []
        #: per module, the keys its last load took (torch, seeing placeholders, lists them
        #: as missing; the post-hook strikes them off)
        self._taken: dict[nn.Module, list[str]] = {}
        for m in self._tree:
            self.handles.append(m.register_state_dict_pre_hook(enter))
            self.handles.append(m.register_state_dict_post_hook(leave))
            if m in self.own:
                self.handles.append(m.register_load_state_dict_pre_hook(load))
                self.handles.append(m.register_load_state_dict_post_hook(loaded))

    def moved(self, where: dict[tuple[FlatParam, int], tuple[FlatParam, int]]) -> None:
        """Parameters moved to other flats (strategies/zero3/regroup.py): (old flat, slot)
        -> (new flat, slot)."""
        for entries in self.own.values():
            entries[:] = [(attr, *where.get((flat, i), (flat, i))) for attr, flat, i in entries]
        self._close()

    # ----- saving -----------------------------------------------------------------------
    def _enter(self, module: nn.Module, keep_vars: bool) -> None:
        if module not in self._tree:
            return
        if self._open and module not in self._open[-1][0]._modules.values():
            # Not a child of the call running: a fresh call (an earlier one that raised
            # left its entries behind). Cached values are only ever a saving, never stale.
            self._close()
        self._open.append((module, keep_vars))

    def _leave(self, module: nn.Module, destination: MutableMapping[str, Any],
               prefix: str) -> None:
        if module not in self._tree:
            return
        keep_vars = next((k for m, k in reversed(self._open) if m is module), False)
        try:
            if module in self.own:
                self._insert(module, destination, prefix, keep_vars)
        finally:
            while self._open:
                if self._open.pop()[0] is module:
                    break
            if not self._open:
                self._close()

    def _close(self) -> None:
        self._open.clear()
        self._values.clear()
        self._read_at.clear()

    def _insert(self, module: nn.Module, destination: MutableMapping[str, Any], prefix: str,
                keep_vars: bool) -> None:
        new: dict[str, torch.Tensor] = {}
        for attr, flat, i in self.own[module]:
            if not _ours(module._parameters.get(attr), flat, i):
                continue  # bound explicitly (DistributedModule.bound): torch wrote it
            key = prefix + attr
            value = self._value(flat, i, keep_vars)
            if key in destination:
                destination[key] = value  # keeps its place, as torch's assignment would
            else:
                new[key] = value
        if not new:
            return
        # torch writes a module's parameters before its buffers and its children's entries,
        # which are already at the end of the destination: move them behind the parameters.
        own = {*module._buffers, *module._modules, "_extra_state"}
        block: list[str] = []
        ordered: Any = destination
        try:
            for key in reversed(ordered):
                if not (key.startswith(prefix)
                        and key[len(prefix):].split(".", 1)[0] in own):
                    break
                block.append(key)
        except TypeError:  # a destination without an order: nothing to move
            block = []
        moved = [(key, destination.pop(key)) for key in reversed(block)]
        destination.update(new)
        destination.update(moved)

    def _value(self, flat: FlatParam, i: int, keep_vars: bool) -> torch.Tensor:
        bound = resolved((flat, i))  # inside a computation on fast weights: theirs
        if bound is not None:
            return bound if keep_vars else bound.detach().clone()
        if keep_vars:
            with torch.enable_grad():  # as a parameter: requires grad where it is trained
                return flat.views(flat.owned())[i]
        if self._read_at.get(flat) != flat.shard._version:
            # The shard's own dtype (a param_dtype gather would round), each parameter a
            # copy of its own (a view would keep the whole flat alive, and saved with it).
            with alone.collective_call("state_dict() of a model sharded by zero3/hsdp"):
                full = flat.gather_laid_out(flat.shard)
            for j, view in enumerate(flat.views(full)):
                self._values[(flat, j)] = view.clone()
            self._read_at[flat] = flat.shard._version
        return self._values[(flat, i)]

    # ----- loading ----------------------------------------------------------------------
    def _load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
              local_metadata: dict[str, Any], error_msgs: list[str]) -> None:
        entries = self.own.get(module)
        if entries is None:
            return
        taken = self._taken.setdefault(module, [])
        taken.clear()
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError(
                "load_state_dict(..., assign=True) on a zero3/hsdp model: its parameters "
                "are flat shards and cannot be replaced by the given tensors; load with "
                "assign=False (the values are copied into the shards)")
        wrote = False
        for attr, flat, i in entries:
            key = prefix + attr
            if key not in state_dict:
                continue  # torch lists it as missing
            # Taken out of this module's copy of the dict: torch must not copy it into the
            # placeholder (it lists it as missing, which _loaded strikes off).
            value = state_dict.pop(key)
            taken.append(key)
            slot = flat.slots[i]
            if not torch.overrides.is_tensor_like(value):
                error_msgs.append(
                    f'While copying the parameter named "{key}", expected torch.Tensor or '
                    f"Tensor-like object from checkpoint but received {type(value)}")
                continue
            if len(slot.shape) == 0 and value.shape == (1,):
                value = value[0]
            if value.shape != slot.shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} "
                    f"from checkpoint, the shape in current model is {slot.shape}.")
                continue
            try:
                _copy_slice(flat, i, value)
                wrote = True
            except Exception as ex:  # reported with the others, as torch does
                error_msgs.append(
                    f'While copying the parameter named "{key}", whose dimensions in the '
                    f"model are {slot.shape} and whose dimensions in the checkpoint are "
                    f"{value.size()}, an exception occurred : {ex.args}.")
        if wrote:
            self._on_load()

    def _loaded(self, module: nn.Module, missing: list[str]) -> None:
        for key in self._taken.pop(module, ()):
            if key in missing:
                missing.remove(key)


def _ours(held: Any, flat: FlatParam, i: int) -> bool:
    """Whether a module's registry entry for parameter ``i`` of ``flat`` is the strategy's
    (a placeholder, a view of the gathered buffer, fast weights bound for a computation),
    so the state dict takes the shards' values; otherwise the caller bound it explicitly."""
    if isinstance(held, ShardedParam) or resolved((flat, i)) is not None:
        return True
    return (isinstance(held, torch.Tensor) and flat.gathered and not held.is_meta
            and held.untyped_storage().data_ptr() == flat.full.untyped_storage().data_ptr())


def _copy_slice(flat: FlatParam, i: int, value: torch.Tensor) -> None:
    """Copy the part of parameter ``i`` of ``flat`` that this rank's shard holds."""
    slot = flat.slots[i]
    for part in flat_part(flat.shard, flat.rank * flat.shard_size, slot.offset, slot.numel):
        paste(part, value.detach().reshape(-1)[part.start:part.stop])
