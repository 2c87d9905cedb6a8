"""The lifetime of a zero3/hsdp unit's gathered parameters: one state per unit.

A unit's state is its own claim on its flats' full buffers (strategies/zero3/units.py moves it,
through named methods only). Claims that graphs hold on a buffer are counted by the flat
itself (strategies/zero3/flat.py: unshards still to backpropagate, pins, owned copies), so a
buffer may outlive its unit's claim, never the other way round.

===========  ==================================================================
SHARDED      no claim: the buffers are freed (unless a graph's claim keeps one)
PREFETCHED   all-gather launched ahead of the forward the last order predicts
FORWARD      open: members bound to the buffers, running or still expected
GATHERED     forward done, buffers kept for the backward (the last unit of the
             forward, ``reshard_after_forward=False``, the root unit's step)
BACKWARD     a backward reached the unit's outputs: gathered (again) for it
===========  ==================================================================

==========  ==============================================  ==============================
from        to (method)                                     when
==========  ==============================================  ==============================
SHARDED,    PREFETCHED (prefetch)                           the previous unit opens and
GATHERED,                                                   a gather was launched (not if
BACKWARD                                                    present or in flight)
SHARDED,    FORWARD (pre_forward)                           its first member runs
GATHERED,
BACKWARD,
PREFETCHED
FORWARD     SHARDED / GATHERED (post_forward, close)        the members expected have run,
                                                            another unit opens, forward ends
PREFETCHED  SHARDED (cancel)                                another unit came, forward ended
SHARDED,    BACKWARD (pre_backward)                         a backward reaches its outputs
GATHERED                                                    (PREFETCHED / FORWARD: left to
                                                            the forward using it)
BACKWARD    SHARDED (post_backward, reduced,                input gradients complete and
            end_backward)                                   every unshard reduced
SHARDED,    GATHERED (gather_for_step, root unit only)      the model's forward starts
GATHERED,
BACKWARD
any other   SHARDED (after_step)                            the shards changed
==========  ==============================================  ==============================
"""

from __future__ import annotations

from enum import Enum


class UnitState(Enum):
    SHARDED = "sharded"
    PREFETCHED = "prefetched"
    FORWARD = "forward"
    GATHERED = "gathered"
    BACKWARD = "backward"


_S, _P, _F, _G, _B = (UnitState.SHARDED, UnitState.PREFETCHED, UnitState.FORWARD,
                      UnitState.GATHERED, UnitState.BACKWARD)

#: The legal transitions (the table above). A self-transition is never one: callers that
#: may repeat a step (a second output's pre-backward) test the state first.
TRANSITIONS: dict[UnitState, frozenset[UnitState]] = {
    _S: frozenset({_P, _F, _G, _B}),
    _P: frozenset({_F, _S}),
    _F: frozenset({_S, _G}),
    _G: frozenset({_P, _F, _B, _S}),
    _B: frozenset({_P, _F, _G, _S}),
}


def check_transition(name: str, old: UnitState, new: UnitState) -> None:
    """Raise on a transition the table does not have: a lifetime bug in metadist, caught
    before it frees a buffer a graph still reads or keeps one nobody frees."""
    if new not in TRANSITIONS[old]:
        raise RuntimeError(
            f"internal error in metadist zero3/hsdp: unit {name} went {old.name} -> "
            f"{new.name}, which its lifetime does not allow (legal from {old.name}: "
            f"{', '.join(sorted(s.name for s in TRANSITIONS[old]))}); please report it "
            "with the model's structure")
