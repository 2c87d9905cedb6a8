"""The optimizer's view of zero3/hsdp's flat shards: each rank steps its shard of every flat
buffer; per-element state is gathered as tensors, per-parameter values copied to each
parameter a flat holds (strategies/sharded_optim.py asks this layout, never the flats)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.optim import Optimizer

from metadist.comm import ops
from metadist.strategies.own_state import Own
from metadist.strategies.placement import OptimizerPlacement, flat_optimizer, per_element
from metadist.strategies.sharded_optim import OptimizerLayout, ParamState
from metadist.strategies.zero3.flat import FlatParam
from metadist.strategies.zero3.sharded_param import ShardedParam, slice_of


class StateByParameter(defaultdict[Any, Any]):
    """``optimizer.state`` of an optimizer stepping flat shards, where a parameter
    ``model.parameters()`` yields also reads its own state, as in one process:
    ``optimizer.state[p]`` is the parameter's slice of each per-element state of its flat
    (views: an in-place change is the optimizer's) and the flat's per-parameter values (its
    step count). Nothing is stored under the parameter."""

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, ShardedParam) and key.source is not None:
            shard = key.source[0].shard
            entry = dict.get(self, shard)
            if entry is not None:
                return {name: slice_of(v, key) if isinstance(v, torch.Tensor)
                        and v.shape == shard.shape else v for name, v in entry.items()}
        return super().__missing__(key)


def state_by_parameter(optimizer: Optimizer) -> None:
    """Make ``optimizer.state`` a :class:`StateByParameter` (again after a load, which
    replaces it)."""
    if not isinstance(optimizer.state, StateByParameter):
        by_parameter = StateByParameter(dict)
        by_parameter.update(optimizer.state)
        optimizer.state = by_parameter


class FlatLayout(OptimizerLayout):
    """Optimizer layout of flat shards: each rank steps its shard of every flat buffer."""

    slices = True

    def __init__(self, flats: list[FlatParam]) -> None:
        self.flats = flats
        self.where = {id(p): (flat, i) for flat in flats for i, p in enumerate(flat.originals)}
        rank = flats[0].rank if flats else 0
        size = flats[0].size if flats else 1
        self.signature = f"flat/{size}/{rank}/{[f.numel for f in flats]}"

    def local_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        ids = {id(p) for p in params}
        local: list[torch.Tensor] = []
        for flat in self.flats:
            inside = [id(p) in ids for p in flat.originals]
            if all(inside):
                local.append(flat.shard)
            elif any(inside):
                raise ValueError(
                    "an optimizer parameter group splits a flat shard; pass the optimizer to "
                    "strategy.setup(model, optimizer) so units are split by parameter group")
        return local

    def full_state(self, optimizer: Optimizer, original: list[torch.Tensor],
                   to: int | None) -> dict[int, ParamState] | None:
        # The generic gather pickles pieces; per-element state is gathered as tensors here.
        index = {id(p): i for i, p in enumerate(original)}
        out: dict[int, ParamState] = {}
        for flat in self.flats:
            entry = optimizer.state.get(flat.shard, {})
            per_param: list[ParamState] = [{} for _ in flat.slots]
            for key in sorted(entry):
                value = entry[key]
                if per_element(key, value, flat.shard.shape):
                    full = flat.gather_laid_out(value)
                    for d, v in zip(per_param, flat.views(full), strict=True):
                        d[key] = v.cpu().clone()
                else:
                    for d in per_param:
                        d[key] = value.clone() if torch.is_tensor(value) else value
            for i, (p, d) in enumerate(zip(flat.originals, per_param, strict=True)):
                if i in flat.skipped:  # the state one process holds for it (unreached.py)
                    own = flat.skipped[i]
                    if own is None:
                        continue
                    d.update({k: v.clone() if torch.is_tensor(v) else v
                              for k, v in own.items()})
                if d:
                    out[index[id(p)]] = d
        return out if to is None or ops.group_info(None)[2] == to else None

    def placements(self, original_groups: list[list[torch.Tensor]]) -> OptimizerPlacement:
        stepped = [t for g in original_groups for t in self.local_params(g)]
        return flat_optimizer(self.flats, original_groups, stepped)

    def set_own(self, own: dict[torch.Tensor, Own], original: list[torch.Tensor]) -> None:
        """A loaded state: each flat's record of skipped parameters (strategies/
        unreached.py) is what the state says, by the parameters' original indices."""
        for flat in self.flats:
            names = {str(i): slot for i, p in enumerate(original)
                     if (slot := self._slot_in(flat, p)) is not None}
            flat.skipped = {names[name]: value for name, value in own.get(flat.shard, {}).items()
                            if name in names}

    def _slot_in(self, flat: FlatParam, p: torch.Tensor) -> int | None:
        where = self.where.get(id(p))
        return where[1] if where is not None and where[0] is flat else None
