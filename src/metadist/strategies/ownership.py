"""Which tensors a strategy set up, and the two checks that stop code from drifting silently.

Gradient sync never depends on which optimizer object steps (every backward on a set-up
module ends synced), but some strategies must also see the optimizer itself: zero1/zero2
step each parameter on its owner rank and refresh the others' copies afterwards, and
``precision="16-mixed"`` unscales gradients and skips overflowing steps. An optimizer built
after setup and never passed to ``strategy.setup_optimizer`` would step every rank on its
own there, so the ranks would drift apart. A global optimizer step pre-hook refuses such a
step with an error that says how to pass it through the strategy; an optimizer that went
through setup carries its step chain (strategies/step_chain.py), which is how it is known.

``strategy.backward(loss)`` on more than one rank refuses a loss whose gradient would reach
no set-up module (the model never went through setup), or ``nn.Parameter`` leaves that belong
to no set-up module: their gradients would stay local to each rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from metadist.strategies import step_chain


@dataclass(frozen=True)
class _Claim:
    ref: weakref.ref[torch.Tensor]
    strategy: str
    #: why an optimizer stepping this tensor must be set up by the strategy (None: needn't)
    optimizer_needed: str | None
    #: sets such an optimizer up at its first step instead of refusing it (a drop-in whose
    #: users build the optimizer after wrapping the model, as FairScale's FSDP users do)
    adopt: Callable[[Optimizer], object] | None = None


_CLAIMS: dict[int, _Claim] = {}
_CLEAN: weakref.WeakKeyDictionary[Optimizer, tuple[int, ...]] = weakref.WeakKeyDictionary()
_hook_installed = False


def _forget(ref: weakref.ref[torch.Tensor], key: int) -> None:
    claim = _CLAIMS.get(key)
    if claim is not None and claim.ref is ref:  # not a newer tensor that reuses the id
        del _CLAIMS[key]


def claim(tensors: Iterable[torch.Tensor], strategy: str, optimizer_needed: str | None,
          adopt: Callable[[Optimizer], object] | None = None) -> None:
    """Record that ``strategy`` set up ``tensors`` (what its optimizer steps); ``adopt``
    sets up an optimizer that steps them unset, at its first step."""
    global _hook_installed
    if not _hook_installed:
        register_optimizer_step_pre_hook(_check_step)
        _hook_installed = True
    for t in tensors:
        _CLAIMS[id(t)] = _Claim(weakref.ref(t, partial(_forget, key=id(t))), strategy,
                                optimizer_needed, adopt)


def claim_of(t: torch.Tensor) -> _Claim | None:
    found = _CLAIMS.get(id(t))
    return found if found is not None and found.ref() is t else None


def _check_step(optimizer: Optimizer, args: object, kwargs: object) -> None:
    if step_chain.chain_of(optimizer) is not None:  # set up by a strategy
        return
    shape = tuple(len(g["params"]) for g in optimizer.param_groups)
    if _CLEAN.get(optimizer) == shape:  # checked, and no group changed since
        return
    stepped = [c for g in optimizer.param_groups for p in g["params"]
               if (c := claim_of(p)) is not None and c.optimizer_needed is not None]
    if not stepped:
        _CLEAN[optimizer] = shape
        return
    first = stepped[0]
    if first.adopt is not None and all(c.adopt is first.adopt for c in stepped):
        first.adopt(optimizer)  # installs the step chain, which runs after this hook
        return
    raise RuntimeError(
        f"this {type(optimizer).__name__} steps {len(stepped)} parameter(s) of a model set up "
        f"by strategy {first.strategy!r}, but was never passed to it: {first.optimizer_needed}. "
        "Pass it through the strategy before stepping: optimizer = "
        "strategy.setup_optimizer(model, optimizer) (or build it before setup and call "
        "strategy.setup(net, optimizer))")


def _leaves(root: torch.autograd.graph.Node) -> Iterator[torch.Tensor]:
    """The leaf tensors a backward from ``root`` would accumulate into."""
    seen: set[torch.autograd.graph.Node] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None or nxt in seen:
                continue
            seen.add(nxt)
            variable = getattr(nxt, "variable", None)  # AccumulateGrad nodes hold their leaf
            if variable is not None:
                yield variable
            else:
                stack.append(nxt)


def check_backward(loss: torch.Tensor, inputs: Sequence[torch.Tensor] | torch.Tensor | None,
                   strategy: str) -> None:
    """Raise if a multi-rank backward of ``loss`` would leave gradients unsynchronised."""
    if inputs is not None:
        leaves = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    elif loss.grad_fn is not None:
        leaves = list(_leaves(loss.grad_fn))
    else:
        return  # no graph: autograd itself says so
    claimed = [t for t in leaves if claim_of(t) is not None]
    if not claimed and leaves and not any(isinstance(t, nn.Parameter) for t in leaves):
        shapes = ", ".join(str(tuple(t.shape)) for t in leaves[:3])
        raise RuntimeError(
            f"strategy {strategy!r}: this backward reaches no parameter, only tensor(s) that "
            f"are not parameters (shapes {shapes}{' ...' if len(leaves) > 3 else ''}): a set-up "
            "model whose parameters need no gradient here, and an input's gradient, say. "
            "strategy.backward averages parameters' gradients across ranks, and there are "
            "none. For an input's gradient (each rank's own, as one process computes it for "
            "its batch) call torch.autograd.grad(loss, x); a weight kept as a plain tensor "
            "would drift apart across ranks: make it an nn.Parameter of the set-up module")
    if not claimed:
        raise RuntimeError(
            f"strategy {strategy!r}: this loss reaches no parameter of a module set up by a "
            "strategy, so its gradients would stay local to each rank and the ranks would "
            "drift apart. Set the model up and compute the loss with what setup returns: "
            "model, optimizer = strategy.setup(net, optimizer); loss = loss_fn(model(x), y)")
    foreign = [t for t in leaves if isinstance(t, nn.Parameter) and claim_of(t) is None]
    if foreign:
        raise RuntimeError(
            f"strategy {strategy!r}: this loss reaches {len(foreign)} nn.Parameter(s) that "
            f"belong to no module set up by a strategy (first: shape "
            f"{tuple(foreign[0].shape)}); their gradients would not be averaged across ranks. "
            "Register them in the module you pass to strategy.setup (e.g. as an attribute of "
            "it), or set up the module that holds them")
