"""Wrap policy: which modules form the units that zero3/hsdp gather and free together.

Post-order over the module tree: a module becomes a unit when it is an instance of one of
``classes`` or, without classes, when the parameters in its subtree that no unit claimed yet
reach ``min_params``. Adjacent small siblings are fused into one unit once together they
reach the threshold, so a run of small layers costs one gather instead of many; a sibling
that is a unit of its own ends a run (parameter-free ones, such as activations, do not).
Containers that never run a forward (``ModuleList``, ``ModuleDict``, ``ParameterList``,
``ParameterDict``) are never units: their children are. Whatever is left, and every parameter
shared by several modules (tied weights), belongs to the root unit, which stays gathered for
the whole step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

#: The attribute of strategies/activation.py's wrapper that holds the wrapped module. A unit is
#: formed from the wrapped module, never from the wrapper: recomputation in backward reruns
#: only what is inside the wrapper, so the unit's gather hooks must sit inside it too.
CHECKPOINTED = "checkpointed"


def state_dict_key(name: str) -> str:
    """A parameter or buffer name as state dicts spell it (checkpoint-wrapper segments
    removed, so checkpoints load with and without activation checkpointing)."""
    return f".{name}".replace(f".{CHECKPOINTED}.", ".")[1:]


def is_checkpoint_wrapper(m: nn.Module) -> bool:
    return bool(getattr(m, "is_checkpoint_wrapper", False))


def _inside_wrapper(m: nn.Module) -> nn.Module:
    inner = m._modules.get(CHECKPOINTED) if is_checkpoint_wrapper(m) else None
    return inner if inner is not None else m


@dataclass
class UnitPlan:
    """Members of a unit and the parameters it owns: (module, attribute, parameter, name)."""

    modules: list[nn.Module]
    params: list[tuple[nn.Module, str, nn.Parameter, str]] = field(default_factory=list)
    is_root: bool = False


# Containers whose forward never runs (their parent's forward reaches into them): the hooks
# of a unit formed from one would never fire, so its parameters would never be gathered.
# They are never a unit nor part of a run; their children are, and what is left of them
# stays with the parent.
NO_FORWARD = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _direct_params(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p


def plan_units(root: nn.Module, min_params: int,
               classes: tuple[type[nn.Module], ...] = ()) -> list[UnitPlan]:
    """Units in registration (roughly execution) order, the root unit last."""
    if min_params < 1:
        raise ValueError(f"min_unit_params must be >= 1, got {min_params}")
    prefix: dict[nn.Module, str] = {}
    for n, m in root.named_modules(remove_duplicate=False):
        prefix.setdefault(m, n)
    users: dict[int, int] = {}
    for m in root.modules():
        for _, p in _direct_params(m):
            users[id(p)] = users.get(id(p), 0) + 1
    shared = {pid for pid, count in users.items() if count > 1}
    claimed: set[int] = set()
    units: list[UnitPlan] = []

    def free(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if id(p) not in claimed
                   and id(p) not in shared)

    def claim(members: list[nn.Module]) -> None:
        plan = UnitPlan([_inside_wrapper(m) for m in members])
        for member in plan.modules:
            for m in member.modules():
                for name, p in _direct_params(m):
                    if id(p) not in claimed and id(p) not in shared:
                        claimed.add(id(p))
                        fqn = f"{prefix[m]}.{name}" if prefix[m] else name
                        plan.params.append((m, name, p, fqn))
        if plan.params:
            units.append(plan)

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        runs = not isinstance(m, NO_FORWARD)
        if m is not root and runs and ((classes and isinstance(m, classes))
                                       or (not classes and free(m) >= min_params)):
            claim([m])
            return
        if classes:
            return
        group: list[nn.Module] = []
        total = 0
        for child in m.children():
            size = free(child)
            if size and isinstance(child, NO_FORWARD):
                group, total = [], 0  # its leftovers stay with m, and m runs them in between
                continue
            if size == 0:
                if next(child.parameters(), None) is not None:
                    # a unit of its own runs in between: fusing across it would gather the
                    # run twice per forward; what is short of the threshold stays with m
                    group, total = [], 0
                continue  # parameter-free layers (activations) do not break a run
            group.append(child)
            total += size
            if total >= min_params:
                claim(group)
                group, total = [], 0

    visit(root)
    rest = UnitPlan([root], is_root=True)
    for m in root.modules():  # a tied parameter appears once per module that uses it
        for name, p in _direct_params(m):
            if id(p) not in claimed:
                rest.params.append((m, name, p, f"{prefix[m]}.{name}" if prefix[m] else name))
    units.append(rest)
    return units
