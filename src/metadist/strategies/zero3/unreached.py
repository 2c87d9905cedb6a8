"""zero3/hsdp: a parameter no loss reached is skipped by the optimizer, as in one process.

One process leaves ``grad=None`` on a parameter no backward reached, and torch's optimizers
skip it: no weight decay, no momentum, no Adam step, no new state. A flat shard holds many
parameters and has one gradient: the elements of an unreached parameter hold zeros, which
Adam or momentum would still turn into a step. So around the optimizer's step:

* before (:meth:`SkipUnreached.before_step`): every rank's record of which parameters its
  gradients reached (:attr:`FlatParam.reached`) is combined in one all-reduce (reached on
  some ranks only is reached: the global gradient exists). The elements of each unreached
  parameter in this rank's shard, and of its per-element optimizer state (Adam's moments,
  the momentum buffer), are kept aside;
* after (:meth:`SkipUnreached.after_step`): they are put back, so the step changed nothing of
  them.

What a flat shard cannot give one parameter is its own per-parameter state: Adam's step
count is one number for the whole shard. A skipped parameter's count therefore falls behind
the shard's, which is exact as long as it stays unreached; the moment a gradient reaches it
again, one process would take its own count and this shard another. That step raises before
anything changes, naming the parameter and the remedy. The state one process holds for such
a parameter (its per-parameter values when it was last stepped, or none at all) is recorded
in :attr:`FlatParam.skipped`, so consolidated and checkpointed optimizer states say what one
process's would (strategies/placement.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from metadist.comm import ops
from metadist.strategies.placement import Part, flat_part, held, paste, per_element
from metadist.strategies.zero3.flat import FlatParam

# (flat, parts of this rank's shard, the shard's values there, per-element state there;
#  None where the state did not exist before the step)
_Kept = tuple[FlatParam, list[Part], list[torch.Tensor], dict[str, list[torch.Tensor]] | None]


class SkipUnreached:
    """The ``"skip_unreached"`` and ``"restore_unreached"`` phases of a zero3/hsdp
    optimizer's step chain (strategies/step_chain.py)."""

    def __init__(self, flats: Sequence[FlatParam], optimizer: Optimizer) -> None:
        self.flats = [flat for flat in flats if flat.shard.requires_grad]
        self.optimizer = optimizer
        self._kept: list[_Kept] = []

    def before_step(self) -> None:
        if not self.flats:
            return
        reached = self._reached_anywhere()
        for flat, mask in zip(self.flats, reached, strict=True):
            _check_fresh(flat, mask)  # all before anything changes
        self._kept = []
        for flat, mask in zip(self.flats, reached, strict=True):
            if flat.shard.grad is not None and not all(mask):
                self._keep(flat, [i for i, hit in enumerate(mask) if not hit])

    def after_step(self) -> None:
        kept, self._kept = self._kept, []
        with torch.no_grad():
            state_of = self.optimizer.state
            for flat, parts, values, before in kept:
                for part, value in zip(parts, values, strict=True):
                    paste(part, value)
                state = state_of.get(flat.shard, {})
                for name, value in state.items():
                    if not per_element(name, value, flat.shard.shape):
                        continue
                    saved = None if before is None else before.get(name)
                    for k, part in enumerate(parts):
                        target = held(part.on(value))
                        if saved is None:  # created by this step: one process has none
                            target.zero_()
                        else:
                            target.copy_(saved[k])

    def _reached_anywhere(self) -> list[list[bool]]:
        """Per flat and slot: did a gradient reach it on any rank (one all-reduce)."""
        # A gradient no record describes was written by other means (an assignment to
        # shard.grad): a dense gradient, every parameter of the shard has one.
        local = [[False] * len(flat.slots) if flat.shard.grad is None
                 else [True] * len(flat.slots) if flat.reached is None
                 else flat.reached for flat in self.flats]
        if ops.group_info(None)[1] == 1:
            # a world of one: its record is the answer. The round trip through the device
            # would cost a GPU two host syncs per step (the copy there, tolist back).
            return [list(mask) for mask in local]
        flags = torch.tensor([hit for mask in local for hit in mask], dtype=torch.uint8,
                             device=self.flats[0].device)
        ops.all_reduce(flags, "max")
        out, start = [], 0
        for flat in self.flats:
            out.append([bool(v) for v in flags[start:start + len(flat.slots)].tolist()])
            start += len(flat.slots)
        return out

    def _keep(self, flat: FlatParam, unreached: list[int]) -> None:
        """Set aside what the step must not change of the ``unreached`` slots, and record
        the state one process holds for each (unless this shard's already says it)."""
        state = self.optimizer.state.get(flat.shard) or {}
        shard = flat.shard.detach()
        lo = flat.rank * flat.shard_size
        parts = [part for i in unreached
                 for part in flat_part(shard, lo, flat.slots[i].offset, flat.slots[i].numel)]
        values = [held(part).clone() for part in parts]
        before = {name: [held(part.on(value)).clone() for part in parts]
                  for name, value in state.items() if per_element(name, value, shard.shape)}
        self._kept.append((flat, parts, values, before if state else None))
        per_parameter = {name: _copy(value) for name, value in state.items()
                         if not per_element(name, value, shard.shape)}
        for i in unreached:
            if i in flat.skipped:
                continue  # already behind: one process's state for it stays what it was
            if not state:
                if not _zeros_are_fresh(self.optimizer, flat):
                    flat.skipped[i] = None  # one process creates no state for it
            elif per_parameter:
                flat.skipped[i] = per_parameter  # frozen where one process left it


def _check_fresh(flat: FlatParam, mask: list[bool]) -> None:
    """A reached parameter whose state one process holds otherwise cannot step exactly."""
    behind = [flat.slots[i].fqn for i, hit in enumerate(mask) if hit and i in flat.skipped]
    if not behind:
        return
    raise RuntimeError(
        f"zero3/hsdp: {', '.join(behind)} got a gradient again after steps that skipped it "
        "(no loss reached it). One process would now step it with its own optimizer state "
        "(e.g. Adam's step count, which did not advance while it was skipped); here it "
        "shares one flat shard, and one step count, with parameters that were stepped, so "
        "the result would differ. Give the module holding it a unit of its own "
        "(metadist.strategy('zero3', wrap_classes=(TheModuleClass,)) or a smaller "
        "min_unit_params), so the whole shard is skipped when it is, or use ddp, zero1 or "
        "zero2, which skip parameters one by one")


def _zeros_are_fresh(optimizer: Optimizer, flat: FlatParam) -> bool:
    """Whether zero per-element state steps like no state at all for ``flat``'s group:
    SGD's momentum buffer starts as the first gradient, which is momentum * 0 + gradient
    unless dampening scales the gradient."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    group = next(g for g in optimizer.param_groups
                 if any(p is flat.shard for p in g["params"]))
    return float(group.get("dampening", 0.0)) == 0.0


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
