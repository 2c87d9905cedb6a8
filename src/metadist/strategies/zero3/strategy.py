"""``"zero3"`` / ``"fsdp"``: parameters, gradients and optimizer state sharded.

Units from the wrap policy (wrap.py) each own flat shards (flat.py).
Just before a unit's forward its shards are all-gathered (the next unit in the previous
forward's order is prefetched) and its modules' parameters become views of the full buffer;
after the forward the buffer is freed (``reshard_after_forward``). In backward a hook on the
unit's outputs gathers it again (prefetching the unit backward reaches next), and the
unshard's backward reduce-scatters the gradient into the shard, asynchronously.

Each unit's lifetime is one state machine (strategies/zero3/unit_state.py has the table)::

    SHARDED ---prefetch---> PREFETCHED ---cancel---> SHARDED
    SHARDED, PREFETCHED, GATHERED, BACKWARD ---pre_forward---> FORWARD
    FORWARD ---post_forward (close)---> GATHERED (kept for the backward) or SHARDED
    SHARDED, GATHERED ---pre_backward---> BACKWARD ---post_backward, reduced---> SHARDED
    any ---after_step---> SHARDED

The module's hooks only route to the unit's named methods (strategies/zero3/units.py: fused units,
frozen units, activation checkpointing's recomputation); graphs' claims on a buffer
(unshards to backpropagate, pins, owned copies) are counted by its flat
(strategies/zero3/flat.py), and buffers a backward reads that no unshard frees by
strategies/zero3/backward_holds.py.

Meta-learning: ``full_parameters()`` returns the full parameters through the differentiable
all-gather, so inner loops adapt full, local fast weights with ``create_graph=True`` and the
outer backward reaches the shards through a reduce-scatter; double backward works (FSDP2
refuses it). ``functional_forward(params, ...)`` runs the module on any such dictionary.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

from metadist.precision import parse_dtype
from metadist.runtime.world import SELF, Group
from metadist.strategies import ownership, step_chain
from metadist.strategies.base import Strategy, StrategyConfig
from metadist.strategies.batchnorm.sync import convert_sync_batchnorm
from metadist.strategies.bind import Place, Rebinding, explicit_parameters_active, held_at, place_of
from metadist.strategies.compile import eager, pieces
from metadist.strategies.ddp import move_optimizer_state
from metadist.strategies.deferred import DeferredSetup, broadcast_state
from metadist.strategies.fast_weights import FastWeights, weigh_slice
from metadist.strategies.module import DistributedModule
from metadist.strategies.placement import ModulePlacement, flat_module
from metadist.strategies.registry import register
from metadist.strategies.sharded_optim import shard_optimizer
from metadist.strategies.state_dict import ShardedStateDict, parameter_order
from metadist.strategies.tensors import grad_norm
from metadist.strategies.tensors.grad_norm import Split
from metadist.strategies.zero3 import sharded_fast
from metadist.strategies.zero3.backward_coordinator import BackwardCoordinator
from metadist.strategies.zero3.flat import FlatParam
from metadist.strategies.zero3.flat_layout import FlatLayout, state_by_parameter
from metadist.strategies.zero3.foreign_runs import (
    Origin,
    library_walking,
    refuse_deepcopy,
    refuse_foreign_run,
)
from metadist.strategies.zero3.regroup import group_into_flats, regroup, split_keys
from metadist.strategies.zero3.shard_grads import reduced_shard_grads
from metadist.strategies.zero3.sharded_param import (
    ShardedParam,
    check_flags,
    set_aside,
    user_parameters,
)
from metadist.strategies.zero3.units import Schedule, Unit
from metadist.strategies.zero3.unreached import SkipUnreached
from metadist.strategies.zero3.wrap import UnitPlan, plan_units


@dataclass(frozen=True)
class FSDPConfig(StrategyConfig):
    #: Size policy: a module whose not-yet-wrapped parameters reach this count becomes a unit.
    min_unit_params: int = 100_000
    #: Class policy (overrides the size policy): every instance of these classes is a unit.
    wrap_classes: tuple[type[nn.Module], ...] = ()
    #: Free a unit's full parameters after its forward (gather again in backward).
    reshard_after_forward: bool = True
    #: Gather the next unit (forward order, reversed in backward) while this one computes;
    #: on fast weights also the next saved weight a backward reads (strategies/zero3/fast_ahead.py).
    prefetch: bool = True
    #: Keep shards, gradients and optimizer state in CPU memory; compute on the device.
    cpu_offload: bool = False
    #: dtype the parameters are gathered and computed in (e.g. "bfloat16"); shards keep theirs.
    #: (FSDP-style mixed precision; ``precision="bf16-mixed"`` autocasts instead.)
    #: Gradients are reduced in ``reduce_dtype`` (default: this compute dtype).
    param_dtype: str | torch.dtype | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_dtype(self.param_dtype)
        if self.min_unit_params < 1:
            raise ValueError(f"min_unit_params must be >= 1, got {self.min_unit_params}")


class ShardedModule(DistributedModule):
    """The user's module with its parameters replaced by gathered views of flat shards."""

    def __init__(self, module: nn.Module, units: list[Unit], config: FSDPConfig) -> None:
        super().__init__(module)
        self.units = units
        self.flats = [flat for unit in units for flat in unit.flats]
        self.shards = nn.ParameterList([flat.shard for flat in self.flats])
        self._config = config
        self._handles: list[Any] = []
        self.state_hooks: ShardedStateDict | None = None
        self._origin = Origin(self)  # copies and patched classes carry it along
        self._trainable_at_setup = [flat.shard.requires_grad for flat in self.flats]
        self._schedule = Schedule(units, reshard_after_forward=config.reshard_after_forward,
                                  prefetch=config.prefetch)
        for unit in units:
            if unit.is_root:
                continue
            for member in unit.modules:
                # eager: never traced, also where a user compiled a module around them
                self._handles.append(member.register_forward_pre_hook(
                    eager(partial(self._route_pre_forward, unit, module)), with_kwargs=True))
                self._handles.append(member.register_forward_hook(
                    eager(partial(self._route_post_forward, unit, module)),
                    always_call=True))  # an exception must not leave the unit running

    # ----- hooks: routed to the units (strategies/zero3/units.py) ---------------------------
    @staticmethod
    def _route_pre_forward(unit: Unit, root: nn.Module, member: nn.Module,
                           args: tuple[Any, ...], kwargs: dict[str, Any]
                           ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        running = sharded_fast.active_for(root)
        if running is not None:  # a forward on fast weights gathers them, not the shards
            running.enter(unit)
            return None
        if explicit_parameters_active(root):  # the parameters were bound for this forward
            return None
        return unit.pre_forward(args, kwargs)

    @staticmethod
    def _route_post_forward(unit: Unit, root: nn.Module, member: nn.Module, args: Any,
                            output: Any) -> Any:
        running = sharded_fast.active_for(root)
        if running is not None:
            running.leave(unit)
        elif not explicit_parameters_active(root):
            unit.post_forward(member, output)
        return output

    def pre_forward(self) -> None:
        if sharded_fast.active_for(self.module) is not None:
            return  # on fast weights (bound()): their forward gathers
        if not explicit_parameters_active(self.module):
            self._schedule.end_forward()
            self.units[-1].gather_for_step()  # the root unit stays gathered through the step

    def _check_own_run(self) -> None:
        """Only the set-up model itself runs on its shards: a copy, a clone, a patched class
        or swapped shards are refused, naming the path (strategies/zero3/foreign_runs.py)."""
        swapped = [f"shards.{name}" for name, shard in self.shards.named_parameters()
                   if shard is not self.flats[int(name)].shard]
        swapped += [slot.fqn for flat in self.flats for slot in flat.slots
                    for module, attr in slot.uses
                    if isinstance(held := held_at(module, attr), torch.Tensor)
                    and not isinstance(held, ShardedParam) and held.shape != slot.shape]
        refuse_foreign_run(self, self._origin, swapped)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        refuse_deepcopy(self)

    def reduced_shard_grads(self) -> AbstractContextManager[None]:
        """Inside, ``torch.autograd.grad`` with respect to this model's shards
        (``model.parameters()``) returns this rank's slice of the gradient averaged over
        ranks (a collective) instead of raising. The slices of one shard group add up to
        the global gradient; nothing else computes this, so it is zero3/hsdp-only code."""
        return reduced_shard_grads()

    def compile_pieces(self) -> list[nn.Module]:
        """Each unit's member module, and the modules holding root-unit parameters: the
        gathers and frees around a member's forward stay out of the compiled code."""
        return pieces(self.module, {m for unit in self.units if not unit.is_root
                                    for m in unit.modules})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_own_run()
        check_flags(self.flats, self._trainable_at_setup)
        for unit in self.units:  # a flat frozen after setup is a frozen flat from now on
            frozen = [flat for flat in unit.flats if not flat.shard.requires_grad]
            if frozen != unit.frozen:
                unit.frozen = frozen
        if sharded_fast.active_for(self.module) is not None:  # inside bound(fast weights)
            return self.run(self.module, args, kwargs)
        out = super().forward(*args, **kwargs)
        self._schedule.end_forward()
        if torch.is_grad_enabled():
            root = self.units[-1]
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: root.pre_backward())
        return out

    def after_step(self) -> None:
        """The shards changed: drop every gathered copy and the graphs' claims on them."""
        self._schedule.after_step()

    # ----- meta-learning and checkpoints ----------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for flat in self.flats:
            if flat.shard.requires_grad:
                # no hook re-gathers for these graphs: they own a copy
                out.update((s.fqn, v) for s, v in zip(flat.slots, flat.owned_views(),
                                                      strict=True))
        return out

    def plain_module(self) -> nn.Module:
        """A copy of the user's module whose parameters are the full ones (trainable: from
        :meth:`full_parameters`, differentiable into the shards; frozen: gathered, detached),
        its buffers the module's own, and without the units' hooks: running it issues no
        collective, and a backward through it reduce-scatters into the shards."""
        full = self.full_parameters()
        values: dict[str, torch.Tensor] = {}
        memo: dict[int, Any] = {id(b): b for b in self.module.buffers()}
        for flat in self.flats:
            gathered = (None if flat.shard.requires_grad
                        else flat.views(flat.owned().detach()))
            for i, slot in enumerate(flat.slots):
                values[slot.fqn] = full[slot.fqn] if gathered is None else gathered[i]
                for module, attr in slot.uses:
                    memo[id(held_at(module, attr))] = None
        copied = copy.deepcopy(self.module, memo)
        ours = {handle.id for handle in self._handles}
        for module in copied.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key in ours & set(hooks):
                    del hooks[key]
        for flat in self.flats:
            for slot in flat.slots:
                for module, attr in slot.uses:
                    memo[id(module)]._parameters[attr] = values[slot.fqn]
        return copied

    def _check_names(self, params: Mapping[str, torch.Tensor], who: str) -> None:
        known = {s.fqn for flat in self.flats for s in flat.slots}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"{who} got unknown parameter names {unknown}; use the names of "
                             "model.full_parameters()")

    def bound(self, params: Mapping[str, torch.Tensor] | FastWeights
              ) -> AbstractContextManager[Any]:
        """The user's module holds full parameters for the block: ``params`` where given,
        gathered copies of its own elsewhere (frozen ones too, which no unit gathers for a
        module bound explicitly), in each parameter's registry entry, so that its
        forward, methods, attributes, ``named_parameters()`` and ``state_dict()`` read them
        as one process's module would. Fast weights (:meth:`fast_weights`) instead: every
        forward of the module's units within the block gathers them, one unit at a time."""
        if isinstance(params, FastWeights):
            return sharded_fast.fast_forward(self.module, self._pieces_of(params),
                                             self.units[-1], self.flats)
        self._check_names(params, "bound")
        placed: list[tuple[Place, torch.Tensor]] = []
        for flat in self.flats:
            values = [params.get(s.fqn) for s in flat.slots]
            if any(v is None for v in values):
                own = flat.views(flat.owned())
                values = [o if v is None else v for v, o in zip(values, own, strict=True)]
            for slot, value in zip(flat.slots, values, strict=True):
                for module, attr in slot.uses:
                    assert value is not None
                    placed.append((place_of(module, attr), value))
        return Rebinding(placed, self.module)

    def _dtype_bound_state(self) -> str | None:
        return "flat shards, their gradients and gathered buffers"

    def _apply(self, fn: Any, recurse: bool = True) -> ShardedModule:
        """``model.to(...)``, ``.float()``, ``.cpu()``: the shards and buffers move or
        convert; the user's parameters (slices of the shards) are set aside for
        the call and put back in their places (registration order kept)."""
        with set_aside(self.flats):
            super()._apply(fn, recurse)
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The user's parameters under their names and global shapes (this rank's slice of
        each: strategies/zero3/sharded_param.py); inside :meth:`bound`, the bound full
        parameters, as a replicated model's would be. The flat shards behind them are
        ``model.shards``."""
        if recurse and explicit_parameters_active(self.module):
            inner = f"{prefix}.module" if prefix else "module"
            return self.module.named_parameters(inner, recurse, remove_duplicate)
        running = sharded_fast.active_for(self.module)
        if recurse and running is not None:  # inside bound(fast weights): theirs, whole
            inner = f"{prefix}.module." if prefix else "module."
            return iter([(inner + slot.fqn, running.whole(flat, i))  # type: ignore[misc]
                         for flat in self.flats for i, slot in enumerate(flat.slots)])
        if library_walking():  # as the library's own walk of the registry finds them
            return super().named_parameters(prefix, recurse, remove_duplicate)
        modules = (self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
                   if recurse else [(prefix, self)])
        return user_parameters(self.flats, [(p, m) for p, m in modules if m is not self.shards],
                               remove_duplicate)

    def fast_weights(self) -> FastWeights:
        """Fast weights of a cooperative inner problem, kept as shards: this rank's slice of
        every trainable flat (strategies/zero3/sharded_fast.py)."""
        if self._fast_layout is None:
            self._fast_layout = sharded_fast.ShardedLayout(self.flats)
        return FastWeights(self._fast_layout, self._fast_layout.initial())

    def functional_forward(self, params: Mapping[str, torch.Tensor] | FastWeights, *args: Any,
                           **kwargs: Any) -> Any:
        if isinstance(params, FastWeights):
            return self._fast_forward(params, args, kwargs)
        self._check_names(params, "functional_forward")
        placed: list[tuple[Place, torch.Tensor]] = []
        frozen, fresh = [], []
        for flat in self.flats:
            values = [params.get(s.fqn) for s in flat.slots]
            if any(v is None for v in values):  # not given: this unit's own parameters
                if flat.shard.requires_grad:
                    full = flat.owned()  # as in full_parameters()
                else:
                    frozen.append(flat)
                    if not flat.gathered:
                        fresh.append(flat)
                    full = flat.unsharded(True)
                gathered = flat.views(full)
                values = [g if v is None else v for v, g in zip(values, gathered, strict=True)]
            placed.extend((place_of(module, attr), value)  # every value is given by now
                          for slot, value in zip(flat.slots, values, strict=True)
                          if value is not None for module, attr in slot.uses)
        with Rebinding(placed, self.module, task=True):
            out = self.run(self.module, args, kwargs)
        # Frozen parameters read here have no unit hooks: gathered again (if need be) when
        # the backward reaches the outputs and kept to its end; freed now if none will come.
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                   and t.requires_grad] if torch.is_grad_enabled() else []
        for t in outputs:
            t.register_hook(lambda g: self._schedule.holds.hold(frozen, pin=True))
        if not outputs:
            for flat in fresh:
                flat.release()
        return out

    def _fast_forward(self, fast: FastWeights, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """The forward on shard fast weights: each unit gathered from its piece as its
        members run, the root unit throughout (strategies/zero3/sharded_fast.py)."""
        with sharded_fast.fast_forward(self.module, self._pieces_of(fast), self.units[-1],
                                       self.flats):
            out = self.run(self.module, args, kwargs)
        return weigh_slice(fast.layout, out, args, kwargs)

    def _pieces_of(self, fast: FastWeights) -> dict[FlatParam, torch.Tensor]:
        if not isinstance(fast.layout, sharded_fast.ShardedLayout) or \
                fast.layout is not self._fast_layout:
            raise ValueError("got fast weights of another model; use this model's "
                             "model.fast_weights()")
        return fast.layout.by_flat(fast.pieces)

    # state_dict/load_state_dict: DistributedModule's, on the user's module, whose modules
    # get their parameters back from the shards through strategies/state_dict.py's hooks.

    def placements(self) -> ModulePlacement:
        """Each parameter's slice of its flat's shard; buffers whole (strategies/placement.py)."""
        return flat_module(self.module, self.flats, self.after_step)

    def split_gradients(self) -> dict[torch.Tensor, Split]:
        """Each shard's gradient is this rank's slice of its flat's gradient."""
        return {t: Split(flat.group) for flat in self.flats if flat.shard.requires_grad
                for t in (flat.shard, *flat.placeholders)}

    def graph_leaves(self) -> list[torch.Tensor]:
        return [flat.shard for flat in self.flats]


@register("zero3", "fsdp")
class Zero3Strategy(Strategy):
    """ZeRO-3 / fully sharded data parallel with flat, padded per-unit shards."""

    Config = FSDPConfig
    config: FSDPConfig
    materializes_by_unit = True

    def __init__(self, config: StrategyConfig) -> None:
        super().__init__(config)
        self._group_of: dict[int, int] = {}

    def groups(self) -> tuple[Group, Group]:
        """(group parameters are sharded over, group the shards are replicated over)."""
        return None, SELF

    def setup(self, model: nn.Module, optimizer: Optimizer | None = None
              ) -> tuple[DistributedModule, Optimizer]:
        if isinstance(optimizer, Optimizer):  # split units by optimizer group (their
            # hyperparameters differ); anything else is refused by the base class
            self._group_of = {id(p): i for i, g in enumerate(optimizer.param_groups)
                              for p in g["params"]}
        return super().setup(model, optimizer)

    def _setup_module(self, model: nn.Module) -> ShardedModule:
        if self.config.sync_batchnorm:
            model = convert_sync_batchnorm(model)
        deferred = DeferredSetup.of(model, self.device)
        if deferred is None:
            model = model.to(self.device)
            broadcast_state([*model.parameters(), *model.buffers()])
        shard_group, replicate_group = self.groups()
        coordinator = BackwardCoordinator()
        units = []
        order = parameter_order(model)  # before the flats take the parameters out
        plans = plan_units(model, self.config.min_unit_params, tuple(self.config.wrap_classes))
        for plan in plans:
            if deferred is not None:  # only this unit whole at a time: its shards stay
                deferred.materialize([p for _, _, p, _ in plan.params])
            units.append(Unit(plan, self._flats(plan, self._group_of, shard_group,
                                                replicate_group, coordinator)))
        sharded = ShardedModule(model, units, self.config)
        # kept alive by the hooks it registers on the user's modules
        sharded.state_hooks = ShardedStateDict(model, sharded.flats, order, sharded.after_step)
        return sharded

    def _flats(self, plan: UnitPlan, group_of: dict[int, int], group: Group,
               replicate: Group, coordinator: BackwardCoordinator) -> list[FlatParam]:
        return group_into_flats(plan.params, group_of, lambda slots, originals: FlatParam(
            slots, originals, group=group, replicate_group=replicate, device=self.device,
            offload=self.config.cpu_offload, param_dtype=parse_dtype(self.config.param_dtype),
            reduce_dtype=self.reduce_dtype, scale=self.reduce_factor, coordinator=coordinator))

    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        if not isinstance(module, ShardedModule):
            raise ValueError("setup_optimizer needs the module returned by this strategy")
        original = {id(held): flat.originals[i] for flat in module.flats
                    for i, held in enumerate(flat.placeholders)}
        for group in optimizer.param_groups:  # built on model.parameters() after setup
            group["params"] = [original.get(id(p), p) for p in group["params"]]
        for p in list(optimizer.state):
            if id(p) in original:
                optimizer.state[original[id(p)]] = optimizer.state.pop(p)
        group_of = split_keys(module.flats, optimizer)
        if group_of is not None:  # groups built after setup cut across flats: split them
            first = module.flats[0]
            regroup(module, optimizer, group_of, lambda plan, keys: self._flats(
                plan, keys, first.group, first.replicate_group, first.coordinator))
            ownership.claim(module.graph_leaves(), self.name, self._optimizer_needed())
            grad_norm.forget(module)
        move_optimizer_state(optimizer)
        shard_optimizer(optimizer, FlatLayout(module.flats))
        state_by_parameter(optimizer)
        optimizer.register_load_state_dict_post_hook(state_by_parameter)
        chain = step_chain.building(optimizer)
        skip = SkipUnreached(module.flats, optimizer)  # one process's grad=None, per parameter
        chain.add("skip_unreached", skip.before_step)
        chain.add("restore_unreached", skip.after_step)
        chain.add("shards_changed", module.after_step)
        return optimizer

    @contextmanager
    def no_sync(self, module: DistributedModule) -> Iterator[None]:
        flats = module.flats if isinstance(module, ShardedModule) else []
        for flat in flats:
            flat.set_sync_grads(False)
        try:
            yield
        finally:
            for flat in flats:
                flat.set_sync_grads(True)

    def _clip_grad_norm(self, module: DistributedModule, max_norm: float,
                        norm_type: float) -> torch.Tensor:
        # every flat's shard on every rank, also one without a gradient here: each group's
        # sum then pairs across ranks (strategies/tensors/grad_norm.py)
        shards = [flat.shard for flat in getattr(module, "flats", ())
                  if flat.shard.requires_grad]
        return grad_norm.clip_grad_norm_(shards, max_norm, norm_type)
