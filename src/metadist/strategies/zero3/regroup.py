"""zero3/hsdp: a unit's parameters grouped into flats, at setup and when the optimizer's
parameter groups come after it.

An optimizer steps each flat shard with one group's hyperparameters, so a flat holds the
parameters of one dtype, optimizer group and ``requires_grad`` (:func:`group_into_flats`).
Built before setup, the optimizer's groups split the units' flats from the start. Built
after setup on ``model.named_parameters()``
(weight decay by name, a learning rate per layer), its groups may cut across flats: each
such flat is split, before any step, into one flat per group (a collective: every rank
gathers the flat once and keeps its shard of each part), and everything that refers to
flats follows: the unit, the schedule, the state-dict hooks, the placeholders the user's
modules and optimizer hold (the same objects, now pointing into the new flats).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.strategies.zero3.flat import FlatParam, Slot
from metadist.strategies.zero3.sharded_param import ShardedParam

#: builds the flats of a unit's parameters, split by ``group_of`` (Zero3Strategy._flats)
Build = Callable[[Any, dict[int, int]], list[FlatParam]]
#: (module, attribute, parameter, qualified name): one use of a parameter in a unit
Use = tuple[nn.Module, str, nn.Parameter, str]


def group_into_flats(params: Sequence[Use], group_of: dict[int, int],
                     make: Callable[[list[Slot], list[nn.Parameter]], FlatParam]
                     ) -> list[FlatParam]:
    """One flat per (dtype, optimizer group, ``requires_grad``) of a unit's parameters, made
    by ``make``; each parameter's registry entries then hold its :class:`ShardedParam` and
    its replica is freed."""
    by_key: dict[tuple[Any, ...], dict[int, list[Use]]] = {}
    for module, attr, p, fqn in params:
        key = (p.dtype, group_of.get(id(p), 0), p.requires_grad)
        by_key.setdefault(key, {}).setdefault(id(p), []).append((module, attr, p, fqn))
    flats = []
    for uses_by_param in by_key.values():
        slots, originals, offset = [], [], 0
        for uses in uses_by_param.values():
            p = uses[0][2]
            slots.append(Slot(uses[0][3], tuple((m, a) for m, a, _, _ in uses), p.shape,
                              offset, p.numel(), tuple(u[3] for u in uses[1:])))
            originals.append(p)
            offset += p.numel()
        flat = make(slots, originals)
        flats.append(flat)
        for index, (slot, p) in enumerate(zip(slots, originals, strict=True)):
            placeholder = ShardedParam(slot.fqn, slot.shape, p.dtype, (flat, index),
                                       p.requires_grad)
            flat.placeholders.append(placeholder)
            for module, attr in slot.uses:
                # Registered as before: every path reads what the attribute holds (the
                # parameter, the gathered views while the unit runs).
                registry: dict[str, Any] = module._parameters
                registry[attr] = placeholder
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # free the replica
    return flats


def split_keys(flats: Sequence[FlatParam], optimizer: Optimizer) -> dict[int, int] | None:
    """id(original parameter) -> the optimizer group stepping it (-1: none), where some flat
    holds parameters of more than one; None where none does."""
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    split = [flat for flat in flats
             if len({group_of.get(id(p), -1) for p in flat.originals}) > 1]
    if not split:
        return None
    return {id(p): group_of.get(id(p), -1) for flat in flats for p in flat.originals}


def regroup(model: Any, optimizer: Optimizer, group_of: dict[int, int], build: Build) -> None:
    """Split every flat of ``model`` (a ShardedModule) whose parameters ``group_of`` puts in
    different groups, one flat per group (module notes). Collective."""
    stepped = [flat for flat in model.flats
               if len({group_of[id(p)] for p in flat.originals}) > 1]
    for flat in stepped:
        if flat.shard.grad is not None or any(p in optimizer.state for p in flat.originals):
            raise ValueError(
                "the optimizer's param groups split parameters zero3/fsdp/hsdp keeps in one "
                f"flat shard ({[s.fqn for s in flat.slots][:4]}), after a backward or a step "
                "already ran on them; set the optimizer up before the first backward "
                "(strategy.setup_optimizer(model, optimizer)), or build it before setup "
                "and pass it to strategy.setup(net, optimizer)")
    replaced: dict[FlatParam, list[FlatParam]] = {}
    for flat in stepped:
        replaced[flat] = _split(flat, group_of, build)
    for unit in model.units:
        unit.flats[:] = [new for flat in unit.flats for new in replaced.get(flat, [flat])]
        unit.frozen = [flat for flat in unit.flats if not flat.shard.requires_grad]
        if unit._schedule is not None:
            unit.join(unit._schedule)
    model.flats[:] = [new for flat in model.flats for new in replaced.get(flat, [flat])]
    model.shards = nn.ParameterList([flat.shard for flat in model.flats])
    model._trainable_at_setup = [flat.shard.requires_grad for flat in model.flats]
    model._fast_layout = None
    model._schedule.unit_of.update((new, unit) for unit in model.units for new in unit.flats)
    model.state_hooks.moved({
        (old, i): (new, j) for old, parts in replaced.items()
        for i, p in enumerate(old.originals)
        for new in parts for j, q in enumerate(new.originals) if q is p})


def _split(flat: FlatParam, group_of: dict[int, int], build: Build) -> list[FlatParam]:
    """New flats for ``flat``'s parameters, one per group, holding their current values;
    the user's modules keep ``flat``'s placeholders, pointed at the new flats."""
    flat.release()
    full = flat.gather_laid_out(flat.shard)
    values = full.split([*(s.numel for s in flat.slots), flat.padded - flat.numel])
    uses: list[Any] = []
    for slot, p, v in zip(flat.slots, flat.originals, values, strict=False):
        p.data = v.view(slot.shape).to(flat.device)
        uses.extend((m, a, p, fqn) for (m, a), fqn in
                    zip(slot.uses, (slot.fqn, *slot.aliases), strict=True))
    news = build(SimpleNamespace(params=uses), group_of)
    held = {id(p): ph for p, ph in zip(flat.originals, flat.placeholders, strict=True)}
    for new in news:
        for j, (slot, p) in enumerate(zip(new.slots, new.originals, strict=True)):
            placeholder: Any = held[id(p)]
            placeholder.source = (new, j)
            placeholder.__dict__.pop("_grad_piece", None)
            new.placeholders[j] = placeholder
            for module, attr in slot.uses:
                registry: dict[str, Any] = module._parameters
                registry[attr] = placeholder
    return news
