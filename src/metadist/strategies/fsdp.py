"""``"zero3"`` / ``"fsdp"``: parameters, gradients and optimizer state sharded.

Units from the wrap policy (strategies/wrap.py) each own flat shards (strategies/flat.py).
Just before a unit's forward its shards are all-gathered (the next unit in the previous
forward's order is prefetched) and its modules' parameters become views of the full buffer;
after the forward the buffer is freed (``reshard_after_forward``). In backward a hook on the
unit's outputs gathers it again (prefetching the unit backward reaches next), and the
unshard's backward reduce-scatters the gradient into the shard, asynchronously.

A unit fused from several modules is gathered and bound once per forward, by the first of its
members to run, and freed when the members the previous forward ran have all run, in any
order (FSDP2's group hooks). A member skipped this time cannot keep it gathered: the unit is
also closed when another unit starts while none of its members runs, or when the forward
ends. Activation checkpointing recomputes inside backward: there a member's forward only
makes sure its unit is gathered.

Frozen parameters (``requires_grad=False``) get flats of their own, which have no gradient
(no reduce-scatter) yet are read by the backward through their layers: strategies/units.py
says when they are gathered and freed in backward.

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
from metadist.strategies import grad_norm
from metadist.strategies.base import Strategy, StrategyConfig, register
from metadist.strategies.compile import eager, pieces
from metadist.strategies.ddp import move_optimizer_state
from metadist.strategies.deferred import DeferredSetup, broadcast_state
from metadist.strategies.flat import (
    BackwardCoordinator,
    FlatLayout,
    FlatParam,
    Slot,
    reduced_shard_grads,
)
from metadist.strategies.grad_norm import Split
from metadist.strategies.module import (
    DistributedModule,
    explicit_parameters,
    explicit_parameters_active,
)
from metadist.strategies.sharded_optim import shard_optimizer
from metadist.strategies.state_dict import ShardedStateDict, parameter_order
from metadist.strategies.sync_batchnorm import convert_sync_batchnorm
from metadist.strategies.units import BackwardHolds, Unit, after_input_grads, in_backward
from metadist.strategies.wrap import UnitPlan, plan_units
from metadist.strategies.zero import clip_sharded_grads


@dataclass(frozen=True)
class FSDPConfig(StrategyConfig):
    #: Size policy: a module whose not-yet-wrapped parameters reach this count becomes a unit.
    min_unit_params: int = 100_000
    #: Class policy (overrides the size policy): every instance of these classes is a unit.
    wrap_classes: tuple[type[nn.Module], ...] = ()
    #: Free a unit's full parameters after its forward (gather again in backward).
    reshard_after_forward: bool = True
    #: Gather the next unit (forward order, reversed in backward) while this one computes.
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
        self._order: list[Unit] = []  # the last forward's unit order: predicts the next one
        self._seen: list[Unit] = []  # this forward's order so far
        self._open: list[Unit] = []
        self._prefetched: list[Unit] = []  # gathered ahead of a forward that has not come yet
        self._handles: list[Any] = []
        unit_of = {flat: unit for unit in units for flat in unit.flats}
        self._holds = BackwardHolds(lambda flat: unit_of[flat].open)
        for unit in units:
            if unit.is_root:
                continue
            if unit.frozen:  # its frozen flats may go once its trainable ones have reduced
                for flat in unit.flats:
                    if flat.shard.requires_grad:
                        flat.on_reduce = partial(self._release_frozen, unit)
            for member in unit.modules:
                # eager: never traced, also where a user compiled a module around them
                self._handles.append(member.register_forward_pre_hook(
                    eager(lambda m, args, kwargs, unit=unit: self._before(unit, args, kwargs)),
                    with_kwargs=True))
                self._handles.append(member.register_forward_hook(
                    eager(lambda m, args, out, unit=unit: self._after(unit, m, out)),
                    always_call=True))  # an exception must not leave the unit running

    # ----- forward and backward hooks -------------------------------------------------
    def _next(self, unit: Unit, step: int) -> Unit | None:
        if unit not in self._order:
            return None
        i = self._order.index(unit) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def _before(self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if explicit_parameters_active():  # functional_forward bound the parameters itself
            return None
        if in_backward():  # recomputation: the original graph's views need the buffer
            unit.wait_gather()
            self._holds.hold(unit.frozen, recomputing=True)
            if torch.is_grad_enabled() and not unit.grad:
                unit.bind()  # reentrant checkpointing backpropagates through the recomputation
            return None
        if not unit.open:
            self._start(unit)
        elif torch.is_grad_enabled() and not unit.grad:
            unit.bind()  # opened under no_grad: this member's graph needs its own unshard
        unit.running += 1
        if not unit.frozen or not torch.is_grad_enabled():
            return None
        # Frozen flats have no gradient to tell when backward is done with them: a node on
        # the member's inputs does (see units.py).
        out = after_input_grads(args, kwargs, partial(self._post_backward, unit))
        if out is not None:
            unit.pending += 1
        return out

    def _start(self, unit: Unit) -> None:
        # Units that are not running are done with, as are gathers made for a unit that did
        # not come: at most this unit and the one prefetched next stay gathered.
        for other in [u for u in self._open if u.running == 0]:
            self._close(other)
        for other in self._prefetched:
            if other is not unit:
                other.free()
        self._prefetched.clear()
        if unit not in self._seen:
            self._seen.append(unit)
        unit.open, unit.waiting, unit.graph = True, set(unit.expected), False
        self._open.append(unit)
        unit.bind()
        nxt = self._next(unit, +1)
        if self._config.prefetch and nxt is not None and nxt.start_gather():
            self._prefetched.append(nxt)

    def _after(self, unit: Unit, member: nn.Module, output: Any) -> Any:
        if explicit_parameters_active() or in_backward() or not unit.open:
            return output
        if torch.is_grad_enabled():
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    unit.graph = True
                    t.register_hook(lambda g, unit=unit: self._before_backward(unit))
        unit.running = max(unit.running - 1, 0)  # 0 if its pre-hook raised before counting
        unit.ran.add(member)
        unit.waiting.discard(member)
        if unit.running == 0 and not unit.waiting:
            self._close(unit)
        return output

    def _close(self, unit: Unit) -> None:
        self._open.remove(unit)
        unit.open, unit.running = False, 0
        # The last unit of the forward is the first of backward: keep it gathered, as long
        # as a backward will come (frozen flats: only if the outputs need one).
        last = bool(self._order) and unit is self._order[-1]
        keep = not self._config.reshard_after_forward or last
        for flat in unit.flats:
            if not (keep and (unit.grad if flat.shard.requires_grad else unit.graph)):
                flat.release()

    def _before_backward(self, unit: Unit) -> None:
        trainable = [flat for flat in unit.flats if flat.shard.requires_grad]
        for flat in trainable:
            if flat.live > 0:
                flat.wait_gather()  # its unshard frees it again
        # the root unit's frozen flats are read anywhere in the backward: kept to its end
        self._holds.hold(unit.frozen, pin=unit.is_root)
        # A graph kept by retain_graph=True is read again after its unshard reduced (live
        # 0): gathered for this backward only. With create_graph=True the recorded graph
        # reads the trainable flats later too, and no hook gathers them then: pinned.
        self._holds.hold(trainable if torch.is_grad_enabled()
                         else [flat for flat in trainable if flat.live <= 0])
        prev = self._next(unit, -1)
        if self._config.prefetch and prev is not None and prev.live:
            prev.start_gather()
            self._holds.hold(prev.frozen, wait=False)

    def _post_backward(self, unit: Unit) -> None:
        """A member's input gradients are complete."""
        unit.pending = max(unit.pending - 1, 0)
        self._release_frozen(unit)

    def _release_frozen(self, unit: Unit) -> None:
        """Free the unit's frozen flats once no backward through it is outstanding (in a
        plain backward: one with create_graph=True pinned what it read)."""
        if unit.backward_done and not torch.is_grad_enabled():
            for flat in unit.frozen:
                flat.release()  # a pinned one stays

    def _end_forward(self) -> None:
        """Close what is still open (members skipped, or an earlier forward that raised)."""
        for unit in list(self._open):
            self._close(unit)
        for unit in self._prefetched:
            unit.free()
        self._prefetched.clear()
        for unit in self.units:
            if unit.ran:  # a forward that ran none of a unit's members teaches nothing
                unit.expected, unit.ran = unit.ran, set()
        if self._seen:  # backward runs this order in reverse; the next forward likely repeats it
            self._order, self._seen = self._seen, []

    def pre_forward(self) -> None:
        if not explicit_parameters_active():
            self._end_forward()
            self.units[-1].bind()  # the root unit stays gathered through the step

    def _check_shards_in_place(self) -> None:
        """``torch.func.functional_call(model, dict(model.named_parameters()), ...)`` swaps the
        shards, which no forward reads (it gathers every rank's own): refuse, never ignore."""
        swapped = [name for name, shard in self.shards.named_parameters()
                   if shard is not self.flats[int(name)].shard]
        if swapped:
            names = ", ".join("shards." + n for n in swapped[:3]) + (" ..." * (len(swapped) > 3))
            raise RuntimeError(
                f"torch.func.functional_call replaced the model's parameters ({names}), which "
                "under zero3/fsdp/hsdp are this rank's flat shards: a forward gathers "
                "every rank's shard, so weights given as shards cannot be this rank's (fast) "
                "weights. Pass full parameters by your module's names: params = "
                "model.full_parameters(), then model.functional_forward(params, x) or "
                "torch.func.functional_call(model, {'module.' + n: p for n, p in "
                "params.items()}, (x,))")

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
        self._check_shards_in_place()
        out = super().forward(*args, **kwargs)
        self._end_forward()
        if torch.is_grad_enabled():
            root = self.units[-1]
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, unit=root: self._before_backward(unit))
        return out

    def after_step(self) -> None:
        """The shards changed: drop every gathered copy and the graphs' claims on them."""
        self._holds.reset()
        for unit in self.units:
            unit.pending = 0
        for flat in self.flats:
            flat.live, flat.owned_copy = 0, None
            flat.release()

    # ----- meta-learning and checkpoints ----------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for flat in self.flats:
            if flat.shard.requires_grad:
                full = flat.owned()  # no hook re-gathers for these graphs: they own a copy
                out.update((s.fqn, v) for s, v in zip(flat.slots, flat.views(full), strict=True))
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
                    memo[id(module.__dict__.get(attr))] = None
        copied = copy.deepcopy(self.module, memo)
        ours = {handle.id for handle in self._handles}
        for module in copied.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key in ours & set(hooks):
                    del hooks[key]
        for flat in self.flats:
            for slot in flat.slots:
                for module, attr in slot.uses:
                    target = memo[id(module)]
                    target.__dict__.pop(attr, None)
                    target._parameters[attr] = values[slot.fqn]
        return copied

    def functional_forward(self, params: Mapping[str, torch.Tensor], *args: Any,
                           **kwargs: Any) -> Any:
        known = {s.fqn: s for flat in self.flats for s in flat.slots}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"functional_forward got unknown parameter names {unknown}; "
                             "use the names of model.full_parameters()")
        saved, frozen, fresh = [], [], []
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
            for slot, value in zip(flat.slots, values, strict=True):
                for module, attr in slot.uses:
                    saved.append((module, attr, module.__dict__.get(attr)))
                    module.__dict__[attr] = value
        try:
            with explicit_parameters():
                out = self.run(self.module, args, kwargs)
        finally:
            for module, attr, old in reversed(saved):
                module.__dict__[attr] = old
        # Frozen parameters read here have no unit hooks: gathered again (if need be) when
        # the backward reaches the outputs and kept to its end; freed now if none will come.
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                   and t.requires_grad] if torch.is_grad_enabled() else []
        for t in outputs:
            t.register_hook(lambda g: self._holds.hold(frozen, pin=True))
        if not outputs:
            for flat in fresh:
                flat.release()
        return out

    # state_dict/load_state_dict: DistributedModule's, on the user's module, whose modules
    # get their parameters back from the shards through strategies/state_dict.py's hooks.

    def split_gradients(self) -> dict[torch.Tensor, Split]:
        """Each shard's gradient is this rank's slice of its flat's gradient."""
        return {flat.shard: Split(flat.group) for flat in self.flats
                if flat.shard.requires_grad}


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
        if optimizer is not None:  # split units by optimizer group (hyperparameters differ)
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
            units.append(Unit(plan, self._flats(plan, shard_group, replicate_group, coordinator)))
        sharded = ShardedModule(model, units, self.config)
        # kept alive by the hooks it registers on the user's modules
        hooks = ShardedStateDict(model, sharded.flats, order, sharded.after_step)
        grad_norm.emptied(hooks.own)
        return sharded

    def _flats(self, plan: UnitPlan, group: Group, replicate: Group,
               coordinator: BackwardCoordinator) -> list[FlatParam]:
        by_key: dict[tuple[Any, ...], dict[int, list[tuple[nn.Module, str, nn.Parameter, str]]]]
        by_key = {}
        for module, attr, p, fqn in plan.params:
            key = (p.dtype, self._group_of.get(id(p), 0), p.requires_grad)
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
            flats.append(FlatParam(
                slots, originals, group=group, replicate_group=replicate, device=self.device,
                offload=self.config.cpu_offload, param_dtype=parse_dtype(self.config.param_dtype),
                reduce_dtype=self.reduce_dtype, scale=self.grad_scale,
                coordinator=coordinator))
            for slot, p in zip(slots, originals, strict=True):
                placeholder = torch.empty(slot.shape, dtype=p.dtype, device="meta")
                for module, attr in slot.uses:
                    module._parameters.pop(attr, None)  # now a plain attribute, bound per forward
                    module.__dict__[attr] = placeholder  # until the unit is first gathered
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # free the replica
        return flats

    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        if not isinstance(module, ShardedModule):
            raise ValueError("setup_optimizer needs the module returned by this strategy")
        move_optimizer_state(optimizer)
        shard_optimizer(optimizer, FlatLayout(module.flats))
        optimizer.register_step_post_hook(lambda *_: module.after_step())
        return optimizer

    @contextmanager
    def no_sync(self, module: DistributedModule) -> Iterator[None]:
        flats = module.flats if isinstance(module, ShardedModule) else []
        for flat in flats:
            flat.sync_grads = False
        try:
            yield
        finally:
            for flat in flats:
                flat.sync_grads = True

    def _clip_grad_norm(self, module: DistributedModule, max_norm: float,
                        norm_type: float) -> torch.Tensor:
        shards = [p for p in module.parameters() if p.grad is not None]
        return clip_sharded_grads(shards, max_norm, norm_type, group=self.groups()[0])
