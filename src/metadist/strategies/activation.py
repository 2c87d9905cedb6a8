"""Activation checkpointing: keep only a block's inputs in forward, recompute its activations
in backward. Trades one extra forward of the wrapped blocks for their activation memory.

``checkpoint_wrapper(module)`` wraps one module; the strategy option
``activation_checkpointing=`` (a module class, a tuple of classes, or a predicate) wraps every
matching submodule before the strategy lays out its parameters. That order matters for
zero3/hsdp: the wrapper sits *inside* the sharding unit, so the recomputation in backward runs
the unit's forward hooks again, which gather the unit's shards just as the first forward did.

Non-reentrant checkpointing (``use_reentrant=False``) is used because it supports
``torch.autograd.grad``, double backward and inputs that do not require grad, which inner
loops of meta-learning rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from metadist.strategies import cooperative
from metadist.strategies.bind import Rebinding, bound_within, captured, explicit_marks
from metadist.strategies.zero3.sharded_fast import Resumed
from metadist.strategies.zero3.wrap import CHECKPOINTED

ModulePredicate = Callable[[nn.Module], bool]
CheckpointPolicy = type[nn.Module] | tuple[type[nn.Module], ...] | ModulePredicate


class CheckpointWrapper(nn.Module):
    """Runs ``module`` under activation checkpointing; state-dict keys stay the module's own."""

    is_checkpoint_wrapper = True  # what strategies/zero3/wrap.py looks for

    def __init__(self, module: nn.Module, *, preserve_rng_state: bool = True) -> None:
        super().__init__()
        if isinstance(module, CheckpointWrapper):
            raise ValueError("this module is already wrapped by checkpoint_wrapper")
        self.checkpointed = module  # attribute name: strategies.wrap.CHECKPOINTED
        self.preserve_rng_state = preserve_rng_state
        # The wrapper is invisible in state dicts: "block.checkpointed.w" is saved as
        # "block.w", so checkpoints load with and without activation checkpointing.
        hide_in_state_dicts(self, CHECKPOINTED)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Recomputation runs in backward, after a functional forward (fast weights of an
        # inner loop) has restored the module's own parameters. Capture what this forward
        # ran with and rebind exactly that for the recomputation (re-enterable: a graph may
        # be recomputed more than once, e.g. in double backward), or the gradients would be
        # those of the wrong weights.
        marks = explicit_marks()
        explicit = bound_within(self.checkpointed, marks)
        rebound = Rebinding(captured(self.checkpointed) if explicit else [],
                            marks=marks if explicit else frozenset())
        # zero3/hsdp fast weights: the recomputation gathers the same fast weights; in a
        # cooperative problem its batch-wide layers reduce over the same group
        recompute = _Both(rebound, _Both(Resumed(), cooperative.Resumed()))

        def contexts() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
            return nullcontext(), recompute

        return checkpoint(self.checkpointed, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, context_fn=contexts,
                          **kwargs)


class _Both:
    """Two re-enterable contexts entered together (re-enterable itself)."""

    def __init__(self, first: AbstractContextManager[Any],
                 second: AbstractContextManager[Any]) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


def hide_in_state_dicts(wrapper: nn.Module, child: str) -> None:
    """Make ``wrapper`` invisible in state dicts: ``wrapper.<child>.w`` is saved as
    ``wrapper.w`` and loaded from it, so checkpoints load with and without the wrapper."""
    wrapper._register_state_dict_hook(partial(_strip_prefix, inner=child + "."))
    wrapper._register_load_state_dict_pre_hook(partial(_add_prefix, inner=child + "."),
                                               with_module=True)


def _strip_prefix(module: nn.Module, state: dict[str, Any], prefix: str,
                  local_metadata: Any, *, inner: str) -> dict[str, Any]:
    for key in [k for k in state if k.startswith(prefix + inner)]:
        state[prefix + key[len(prefix + inner):]] = state.pop(key)
    return state


def _add_prefix(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any,
                inner: str) -> None:
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + inner)]:
        state[prefix + inner + key[len(prefix):]] = state.pop(key)


def checkpoint_wrapper(module: nn.Module, *, preserve_rng_state: bool = True
                       ) -> CheckpointWrapper:
    """Wrap ``module`` so its activations are recomputed in backward instead of stored."""
    return CheckpointWrapper(module, preserve_rng_state=preserve_rng_state)


def _matcher(policy: CheckpointPolicy) -> ModulePredicate:
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return lambda m: isinstance(m, policy)
    if isinstance(policy, tuple) and policy and all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in policy):
        return lambda m: isinstance(m, policy)
    if callable(policy) and not isinstance(policy, type):
        return policy
    raise TypeError(f"activation_checkpointing takes a module class, a tuple of classes or a "
                    f"predicate module -> bool; got {policy!r}")


def apply_activation_checkpointing(model: nn.Module, policy: CheckpointPolicy) -> nn.Module:
    """Wrap every submodule of ``model`` that ``policy`` selects (outermost match wins, the
    root itself is never wrapped); returns ``model``. Raises if nothing matches, since a
    silently ignored policy would cost the memory the user meant to save."""
    match = _matcher(policy)
    wrapped = 0

    def visit(parent: nn.Module) -> None:
        nonlocal wrapped
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper):
                continue
            if match(child):
                setattr(parent, name, checkpoint_wrapper(child))
                wrapped += 1
            else:
                visit(child)

    visit(model)
    if wrapped == 0:
        raise ValueError(f"activation_checkpointing={policy!r} matched no submodule of "
                         f"{type(model).__name__}; pass the class of its repeated blocks "
                         "(e.g. the transformer layer) or a predicate that selects them")
    return model
