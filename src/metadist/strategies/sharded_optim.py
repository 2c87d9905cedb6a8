"""Shard the user's optimizer in place: each rank's optimizer steps only the tensors it owns.

The optimizer object the user built stays the one they use: same class, same param-group
dicts (so LR schedulers bound to it keep working), its per-group hyperparameters untouched.
Only each group's ``"params"`` list is rebound to this rank's tensors (owned parameters for
zero1/zero2, flat shards for zero3) and the state is cut to match.

State dicts: ``optimizer.state_dict()`` is this rank's shard (local, tagged with the layout it
came from); :func:`full_state_dict` consolidates the plain single-process format (collective);
``optimizer.load_state_dict`` accepts either, so a full checkpoint from any strategy, world
size or a plain optimizer loads into a sharded one.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.optim import Optimizer

from metadist.strategies.optimizer_state import cut_state, gather_state
from metadist.strategies.own_state import OWN, Own
from metadist.strategies.placement import (
    OptimizerPlacement,
    numbered_groups,
    replicated_optimizer,
)

_TAG = "metadist_shard"
ParamState = dict[str, Any]


class OptimizerLayout(ABC):
    """How a strategy spreads an optimizer's parameters over ranks."""

    #: a name that identifies the layout (strategy, world size, partition) in tagged dicts
    signature: str = ""
    #: the tensors a rank steps are flat slices of parameters, not whole parameters
    slices: bool = False

    @abstractmethod
    def local_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors this rank steps for a group whose original parameters are ``params``."""

    def full_state(self, optimizer: Optimizer, original: list[torch.Tensor],
                   to: int | None) -> dict[int, ParamState] | None:
        """Collective: state per original parameter index, on every rank or only on ``to``."""
        return gather_state(self.placements([original]), optimizer, to)

    @abstractmethod
    def placements(self, original_groups: list[list[torch.Tensor]]) -> OptimizerPlacement:
        """Where the state of each original parameter lives on this rank
        (strategies/placement.py); ``original_groups``: the user's param groups."""

    def local_state(self, full: dict[int, ParamState], original: list[torch.Tensor]
                    ) -> tuple[dict[torch.Tensor, ParamState], dict[torch.Tensor, Own]]:
        """This rank's state for its tensors, cut from a full state by original index, and
        the parameters whose own state differs from their tensor's."""
        return cut_state(self.placements([original]).stepped, full)

    def set_own(self, own: dict[torch.Tensor, Own], original: list[torch.Tensor]) -> None:
        """Take a loaded record of parameters whose state differs from their tensor's.
        Whole parameters never differ from themselves: nothing to keep."""
        return None


@dataclass
class Sharding:
    """Attached to a sharded optimizer as ``optimizer.metadist_sharding``."""

    layout: OptimizerLayout
    original_groups: list[list[torch.Tensor]]

    @property
    def original(self) -> list[torch.Tensor]:
        return [p for group in self.original_groups for p in group]

    def placements(self) -> OptimizerPlacement:
        """The layout's description, with the tag its local state dicts carry."""
        return replace(self.layout.placements(self.original_groups),
                       tag={_TAG: self.layout.signature})


# Optimizers whose update of one element reads other elements. Matched by class name along
# the MRO, so subclasses are caught and classes missing from older torch releases cost nothing.
_WHOLE_MODEL = {"LBFGS": "its line search and curvature pairs read every parameter at once"}
_PER_MATRIX = {
    "Adafactor": "it factors each matrix's second moment over its rows and columns",
    "Muon": "it orthogonalises each matrix's update as a whole",
}


def _check_shardable(optimizer: Optimizer, layout: OptimizerLayout) -> None:
    names = {cls.__name__ for cls in type(optimizer).__mro__}
    for name, why in _WHOLE_MODEL.items():
        if name in names:
            raise ValueError(
                f"{type(optimizer).__name__} cannot be sharded: {why}, and each rank steps only "
                "its share of them. Use a replicated strategy (ddp) for it")
    if not layout.slices:
        return
    for name, why in _PER_MATRIX.items():
        if name in names:
            raise ValueError(
                f"{type(optimizer).__name__} cannot step flat slices of parameters (zero3, "
                f"fsdp, hsdp): {why}. Use zero1 or zero2, which give each rank whole "
                "parameters, or an element-wise optimizer (SGD, Adam, AdamW, RMSprop, ...)")


def shard_optimizer(optimizer: Optimizer, layout: OptimizerLayout) -> Sharding:
    """Rebind ``optimizer``'s groups to this rank's tensors and cut its state to match."""
    if hasattr(optimizer, "metadist_sharding"):
        raise ValueError("this optimizer is already sharded by a strategy; build a new one")
    _check_shardable(optimizer, layout)
    original_groups = [list(g["params"]) for g in optimizer.param_groups]
    sharding = Sharding(layout, original_groups)
    original = sharding.original
    existing = {i: dict(optimizer.state[p]) for i, p in enumerate(original)
                if optimizer.state.get(p)}
    for group, params in zip(optimizer.param_groups, original_groups, strict=True):
        group["params"] = layout.local_params(params)
    optimizer.state = defaultdict(dict)
    if existing:  # the user stepped before setup: keep that state, cut to this rank
        local, own = layout.local_state(existing, original)
        optimizer.state.update(local)
        layout.set_own(own, original)
    optimizer.register_state_dict_post_hook(_tag)
    optimizer.register_load_state_dict_pre_hook(_to_local)
    optimizer.metadist_sharding = sharding  # type: ignore[attr-defined]
    _zero_every_grad(optimizer, original)
    return sharding


def _zero_every_grad(optimizer: Optimizer, original: list[torch.Tensor]) -> None:
    """``zero_grad`` must still clear the gradients of parameters this rank does not step
    (zero1 holds averaged gradients of every parameter), with the caller's set_to_none."""
    local = {id(t) for g in optimizer.param_groups for t in g["params"]}
    others = [p for p in original if id(p) not in local]
    if not others:
        return
    zero_own = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        zero_own(set_to_none)
        for p in others:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:  # as torch's zero_grad: gradients may be views (of our buckets)
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def _tag(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    sharding: Sharding = optimizer.metadist_sharding  # type: ignore[attr-defined]
    state_dict[_TAG] = sharding.layout.signature
    return state_dict


def _to_local(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Load hook: a tagged shard of this layout loads as is; anything else is a full dict."""
    sharding: Sharding = optimizer.metadist_sharding  # type: ignore[attr-defined]
    state_dict = dict(state_dict)
    tag = state_dict.pop(_TAG, None)
    own_by_position = state_dict.pop(OWN, {})
    if tag is not None:
        if tag != sharding.layout.signature:
            raise ValueError(
                "this optimizer state is a shard of another layout "
                f"({tag!r}, here {sharding.layout.signature!r}); save it with "
                "strategy.optimizer_state_dict(optimizer) (full) to load it elsewhere")
        stepped = [t for g in optimizer.param_groups for t in g["params"]]
        sharding.layout.set_own({stepped[j]: own for j, own in own_by_position.items()},
                                sharding.original)
        return state_dict
    original = sharding.original
    groups = state_dict["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g) for g in sharding.original_groups]:
        raise ValueError("the optimizer state does not match this model's parameter groups "
                         f"({[len(g['params']) for g in groups]} parameters per group, here "
                         f"{[len(g) for g in sharding.original_groups]})")
    position = {pid: i for i, pid in enumerate(pid for g in groups for pid in g["params"])}
    full = {position[pid]: entry for pid, entry in state_dict["state"].items()}
    local, own = sharding.layout.local_state(full, original)
    sharding.layout.set_own(own, original)
    index = {id(t): i for i, t in enumerate(t for g in optimizer.param_groups for t in g["params"])}
    return {"state": {index[id(t)]: entry for t, entry in local.items()},
            "param_groups": numbered_groups(groups, [len(g["params"])
                                                    for g in optimizer.param_groups])}


def full_state_dict(optimizer: Optimizer, to: int | None = None) -> dict[str, Any] | None:
    """Consolidate a sharded optimizer's state into the plain single-process format.

    Collective: every rank calls it. Returns the dict on every rank (``to=None``) or only on
    global rank ``to`` (``None`` elsewhere). An unsharded optimizer returns its own dict.
    """
    sharding: Sharding | None = getattr(optimizer, "metadist_sharding", None)
    if sharding is None:
        where = replicated_optimizer(optimizer)
        if all(s.state_shape is None for s in where.stepped):
            # replicated: every rank holds it all; a copy, as for shards
            return copy.deepcopy(optimizer.state_dict())
        # zero3/hsdp parameters stepped as they are: each rank holds their slices' state
        sliced = gather_state(where, optimizer, to)
        if sliced is None:
            return None
        return {"state": dict(sorted(sliced.items())),
                "param_groups": numbered_groups(optimizer.param_groups, where.counts)}
    original = sharding.original
    state = sharding.layout.full_state(optimizer, original, to)
    if state is None:
        return None
    groups = numbered_groups(optimizer.param_groups, [len(g) for g in sharding.original_groups])
    return {"state": dict(sorted(state.items())), "param_groups": groups}
