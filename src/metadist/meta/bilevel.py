"""An upper problem's hypergradient through its lower problems, as the engine computes it.

For each ``u2l`` lower problem the loss functions of :func:`~metadist.meta.hypergradient` are
the problems' own ``training_step`` calls, with the lower problem bound to the inner
parameters and the upper problem to the hyperparameters (everything else runs on parameters
no gradient reaches; see ``Engine._bound``). Every data-dependent quantity is averaged over
ranks by ``grad_sync``, so the result is the single-process hypergradient of the global
batch, on every rank.

Ragged global batches: ``grad_sync`` averages with 1/N, so each rank's loss is multiplied by
its share of the batch times N (exactly 1.0, and then left alone, when ranks hold equally
many samples).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from metadist.meta.hypergrad import (
    CGConfig,
    DartsConfig,
    HypergradConfig,
    NeumannConfig,
    UnrolledConfig,
    hypergradient,
)
from metadist.meta.problem import Problem, loss_of
from metadist.meta.transforms import sgd

if TYPE_CHECKING:
    from metadist.meta.engine import Engine

LossFn = Callable[[Any, tuple[Tensor, ...]], Tensor]


def weighted(loss: Tensor, share: float) -> Tensor:
    """``loss`` times this rank's batch share (times N); untouched, bit for bit, at 1.0."""
    return loss if share == 1.0 else loss * share


def upper_gradient(engine: Engine, upper: Problem) -> dict[str, Tensor]:
    """d(upper's loss)/d(upper's parameters) through every ``u2l`` lower problem, averaged
    over ranks. The direct part is counted once (through the first lower problem)."""
    # Replicated strategies: the hyperparameters are the module's own leaf parameters (the
    # upper module then runs its own forward: no rebinding); autograd.grad never accumulates
    # into them. zero3/hsdp: clones of the gathered parameters, bound explicitly.
    start = upper.wrapped.full_parameters() if upper.replicated else upper.params(clone=True)
    names = list(start)
    lam = tuple(t if upper.replicated else t.requires_grad_() for t in start.values())
    sync = engine._sync
    total: list[Tensor] | None = None
    for i, lower_name in enumerate(engine.u2l[upper.name]):
        lower = engine.problems[lower_name]
        outer = _outer_fn(engine, upper, lower, names, direct=i == 0)
        if lower.config.first_order:
            if i > 0:
                continue  # no response term, and the direct part is already counted
            g = torch.autograd.grad(outer(lower.params(), lam), lam, allow_unused=True,
                                    materialize_grads=True)
            parts = tuple(sync(g)) if sync is not None else g
        else:
            method, config = method_of(lower, upper)
            # the methods take fresh leaves of these; only gathered zero3 buffers need a copy
            params = (lower._theta0 if method == "unrolled"
                      else lower.params(clone=not lower.replicated))
            parts = hypergradient(method, outer, _inner_fn(engine, upper, lower, names), params,
                                  lam, config, grad_sync=sync)
        total = list(parts) if total is None else [a + b for a, b in
                                                    zip(total, parts, strict=True)]
    assert total is not None
    return dict(zip(names, total, strict=True))


def method_of(lower: Problem, upper: Problem) -> tuple[str, HypergradConfig]:
    """The lower problem's method and its config; defaults from its optimizer's lr."""
    given, lr = lower.config.hypergrad, float(lower.optimizer.param_groups[0]["lr"])
    match lower.config.method:
        case "darts":
            return "darts", given or DartsConfig(xi=lr)
        case "neumann":
            return "neumann", given or NeumannConfig(alpha=lr)
        case "cg":
            return "cg", given or CGConfig()
        case "unrolled":
            if not lower._record:
                raise RuntimeError(
                    f"{upper.name!r} steps before {lower.name!r} took a step to unroll; "
                    f"list {upper.name!r} in dependencies['l2u'][{lower.name!r}]")
            opt = given.optimizer if isinstance(given, UnrolledConfig) else sgd(lr)
            return "unrolled", UnrolledConfig(steps=len(lower._record), optimizer=opt)
    raise AssertionError(lower.config.method)  # ProblemConfig validated it


def _outer_fn(engine: Engine, upper: Problem, lower: Problem, names: list[str],
              direct: bool) -> LossFn:
    def outer(theta: Any, lam: tuple[Tensor, ...]) -> Tensor:
        # Without the direct part, upper's own calls see lam detached: dF/dlam = 0 here.
        with engine._bound({lower.name: theta, upper.name: _lam(upper, names, lam, direct)}):
            loss = weighted(loss_of(upper.training_step(upper.batch), upper.name),
                            upper.batch_share)
        scaler = upper.strategy.scaler if upper.strategy is not None else None
        # 16-mixed: a scaled outer loss scales the hypergradient (linear in it), which keeps
        # fp16 products from underflowing; the optimizer's hook unscales and checks it.
        return scaler.scale(loss) if scaler is not None else loss

    return outer


def _inner_fn(engine: Engine, upper: Problem, lower: Problem, names: list[str]) -> LossFn:
    # unrolled: the k-th call replays the window's k-th step; the others: the current batch.
    steps: Iterator[list[tuple[Any, float]]] | None = (
        iter(lower._record) if lower.name in engine._replays else None)

    def inner(theta: Any, lam: tuple[Tensor, ...]) -> Tensor:
        batches = next(steps) if steps is not None else [(lower.batch, lower.batch_share)]
        with engine._bound({lower.name: theta, upper.name: _lam(upper, names, lam, True)}):
            losses = [weighted(loss_of(lower.training_step(b), lower.name), w)
                      for b, w in batches]
        # the mean over an accumulation's micro-batches, as the real step took it
        return sum(losses[1:], losses[0]) / len(losses) if len(losses) > 1 else losses[0]

    return inner


def _lam(upper: Problem, names: list[str], lam: tuple[Tensor, ...], live: bool
         ) -> dict[str, Tensor] | None:
    """How the upper problem runs: its own forward when ``lam`` are its own parameters (None),
    else bound to ``lam``, detached unless ``live``."""
    if live and upper.replicated:
        return None
    return dict(zip(names, lam if live else tuple(t.detach() for t in lam), strict=True))
