"""The one ordered chain of work around ``optimizer.step()``, installed by the base strategy.

Several parties must act on the user's optimizer around its step: the strategy finishes the
gradient sync that ``no_sync`` deferred and refreshes parameters from their owners, zero3
drops gathered copies of the old parameters, and the ``"16-mixed"`` loss scaler unscales,
skips overflowing steps and updates its scale. Their order matters (the scaler must see
synced gradients; its update must come after the step), so instead of each registering torch
hooks in call order, ``Strategy.setup_optimizer`` installs one :class:`StepChain` per
optimizer, which registers one torch pre-step and one post-step hook, and each party fills a
named phase. The phases run in this fixed order:

========================  =========================================================
before ``step()``
``"agree"``               every rank at the same step with the same hyperparameters
                          (strategies/agreement.py)
``"sync_grads"``          finish the gradient sync ``no_sync`` left local (ddp, zero1/2)
``"wait_params"``         finish the parameter refresh still in flight (zero1/2 overlap)
``"unscale"``             unscale, check every rank for inf/NaN, drop the step's gradients
                          if any (16-mixed)
``"skip_unreached"``      set aside what the step must not change of parameters no
                          gradient reached (zero3, hsdp: strategies/zero3/unreached.py)
after ``step()``
``"restore_unreached"``   put it back
``"shards_changed"``      drop gathered copies of the old parameters (zero3, hsdp)
``"refresh_params"``      refresh every rank's parameters from their owners (zero1/2)
``"update_scale"``        grow or back off the loss scale (16-mixed)
``"running_stats"``       combine the ranks' updates of running statistics from their own
                          batches (strategies/batchnorm/running_stats.py)
========================  =========================================================

A step the scaler skipped still runs the post phases: the refresh then copies unchanged
values, and the scale backs off. Hooks the user registers on the optimizer run after the
chain's pre phases (gradients synced and unscaled) and after its post phases (parameters
refreshed), as torch runs hooks in registration order. An optimizer that was never set up
has no chain: strategies/ownership.py refuses its step where the parameters it steps need one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

from torch.optim import Optimizer

PrePhase = Literal["agree", "sync_grads", "wait_params", "unscale", "skip_unreached"]
PostPhase = Literal["restore_unreached", "shards_changed", "refresh_params", "update_scale",
                    "running_stats"]
Phase = PrePhase | PostPhase
PRE: tuple[PrePhase, ...] = get_args(PrePhase)
POST: tuple[PostPhase, ...] = get_args(PostPhase)
#: A phase's work (a bound method of the party that owns the phase).
Step = Callable[[], None]

# Kept on the optimizer itself (as sharding keeps ``metadist_sharding``): a table keyed by
# optimizer would keep alive every optimizer whose phases hold a reference to it.
_ATTR = "metadist_step_chain"


class StepChain:
    """The named phases of one optimizer's step, each filled by at most one party."""

    def __init__(self) -> None:
        self._steps: dict[Phase, Step] = {}
        self.installed = False

    def add(self, phase: Phase, step: Step) -> None:
        """Run ``step()`` in ``phase`` (see the module docstring for the order)."""
        if phase not in PRE and phase not in POST:
            raise ValueError(f"step phase {phase!r} is not known; choose one of: "
                             f"{', '.join((*PRE, *POST))}")
        if phase in self._steps:
            raise ValueError(f"step phase {phase!r} is already filled by "
                             f"{_name(self._steps[phase])}; each phase has one owner")
        self._steps[phase] = step

    def phases(self) -> list[Phase]:
        """The filled phases, in the order they run."""
        return [p for p in (*PRE, *POST) if p in self._steps]

    def run_pre(self, optimizer: Optimizer, args: Any = None, kwargs: Any = None) -> None:
        for phase in PRE:
            if phase in self._steps:
                self._steps[phase]()

    def run_post(self, optimizer: Optimizer, args: Any = None, kwargs: Any = None) -> None:
        for phase in POST:
            if phase in self._steps:
                self._steps[phase]()

    def install(self, optimizer: Optimizer) -> None:
        """Hook ``optimizer``: from now on its ``step()`` runs the phases."""
        optimizer.register_step_pre_hook(self.run_pre)
        optimizer.register_step_post_hook(self.run_post)
        self.installed = True


def _name(step: Step) -> str:
    return getattr(step, "__qualname__", None) or repr(step)


def building(optimizer: Optimizer) -> StepChain:
    """The chain a strategy's ``_setup_optimizer`` adds its phases to (made on first use;
    hooked into the optimizer by :func:`install` once setup succeeded)."""
    chain: StepChain | None = getattr(optimizer, _ATTR, None)
    if chain is None:
        chain = StepChain()
        setattr(optimizer, _ATTR, chain)
    return chain


def chain_of(optimizer: Optimizer) -> StepChain | None:
    """The installed chain of an optimizer a strategy set up (None: never set up)."""
    chain: StepChain | None = getattr(optimizer, _ATTR, None)
    return chain if chain is not None and chain.installed else None


def check_not_set_up(optimizer: Optimizer) -> None:
    """Raise if ``optimizer`` already went through ``strategy.setup_optimizer``: its phases
    would run twice per step (a second gradient sync, a scale updated twice)."""
    if chain_of(optimizer) is not None:
        raise ValueError(f"this {type(optimizer).__name__} is already set up by a strategy; "
                         "build a new optimizer on the original model's parameters (e.g. "
                         "torch.optim.Adam(net.parameters())) to set it up again")


def install(optimizer: Optimizer) -> StepChain:
    """Hook the chain built for ``optimizer`` into it (setup succeeded)."""
    chain = building(optimizer)
    chain.install(optimizer)
    return chain


def discard(optimizer: Optimizer) -> None:
    """Forget a chain whose setup failed half way, so a retry starts empty."""
    chain: StepChain | None = getattr(optimizer, _ATTR, None)
    if chain is not None and not chain.installed:
        delattr(optimizer, _ATTR)
