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

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from metadist.meta import fast_space
from metadist.meta.directional import adam_scale
from metadist.meta.fast_space import Hparams
from metadist.meta.hypergrad import HypergradConfig, hypergradient
from metadist.meta.methods import hypergradient_method
from metadist.meta.problem import Problem, loss_of
from metadist.meta.response import response
from metadist.strategies.fast_weights import FastWeights

if TYPE_CHECKING:
    from metadist.meta.engine import Engine

LossFn = Callable[[Any, tuple[Tensor, ...]], Any]


def weighted(loss: Tensor, share: float) -> Tensor:
    """``loss`` times this rank's batch share (times N); untouched, bit for bit, at 1.0."""
    return loss if share == 1.0 else loss * share


def upper_gradient(engine: Engine, upper: Problem) -> dict[str, Tensor] | FastWeights:
    """d(upper's loss)/d(upper's parameters) along every hypergradient path of ``upper``
    (:attr:`Engine.paths`), averaged over ranks. The direct part is counted once. Under
    zero3/hsdp it is taken with respect to the upper problem's shard pieces, and returned
    as fast weights of them: no rank holds the upper model whole."""
    names, lam = _hparams(upper, pieces=True)
    total: list[Tensor] | None = None
    direct = True  # the first path that reaches upper's loss carries dF/dlam
    for path in engine.paths[upper.name]:
        chain = [engine.problems[n] for n in path[1:-1]]
        if any(p.config.first_order for p in chain):
            continue  # no response term through a first-order problem
        # dF/dlam rides on the first path that goes straight back to upper (its first link
        # is the only one evaluating upper's loss with lam live); otherwise added below.
        carries = direct and len(chain) == 1
        parts = path_gradient(engine, upper, chain, names, lam, direct=carries)
        direct = direct and not carries
        total = list(parts) if total is None else [a + b for a, b in
                                                    zip(total, parts, strict=True)]
    if direct:  # no path carried it: the direct gradient at the current parameters
        lower = engine.problems[engine.paths[upper.name][0][1]]
        outer = _loss_fn(engine, upper, lower, upper, names, live=True, scale=True)
        loss = outer(lower.inner_params(), lam.tree())
        if not loss.requires_grad and total is None:
            first = [n for path in engine.paths[upper.name] for n in path[1:-1]
                     if engine.problems[n].config.first_order]
            raise ValueError(
                f"problem {upper.name!r}'s loss reaches its parameters only through its lower "
                f"problems, and ProblemConfig(first_order=True) on {sorted(set(first))} drops "
                "that response: its hypergradient would always be zero. Remove first_order="
                "True there (Betty's first_order is another setting: it sits on the upper "
                "problem, and True keeps the response)")
        g = torch.autograd.grad(loss, lam, allow_unused=True, materialize_grads=True)
        parts = fast_space.sync_lam(engine._sync, g, lam)
        total = list(parts) if total is None else [a + b for a, b in
                                                    zip(total, parts, strict=True)]
    assert total is not None
    if lam.layout is not None:
        return FastWeights(lam.layout, tuple(total))
    return dict(zip(names, total, strict=True))


def path_gradient(engine: Engine, upper: Problem, chain: list[Problem], names: list[str],
                  lam: Hparams, *, direct: bool) -> tuple[Tensor, ...]:
    """One path's term: upper's loss depends on ``chain[0]``, whose response depends on
    ``chain[1]``, ..., the last's on ``upper``. The first link runs its method on upper's
    loss; each later one applies its response product (:func:`~metadist.meta.response.
    response`) to the vector the previous link produced."""
    sync = engine._sync
    v: tuple[Tensor, ...] = ()
    pieces = False  # v: pieces of curr's shards (the previous link's hyperparameters were)
    for i, curr in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else upper
        nxt_names, nxt_lam = (names, lam) if nxt is upper else _hparams(nxt, pieces=True)
        method, config = method_of(curr, nxt)
        params = (curr._theta0 if hypergradient_method(method).replays_steps
                  else curr.inner_params(clone=not curr.replicated))
        inner = _inner_fn(engine, nxt, curr, nxt_names)
        if i == 0:
            outer = _loss_fn(engine, upper, curr, nxt, nxt_names,
                             live=direct and nxt is upper, scale=True)
            v = hypergradient(method, outer, inner, params, nxt_lam, config, grad_sync=sync)
        else:
            if isinstance(params, FastWeights) and not pieces:  # v: whole, by name
                v = params.like(dict(zip(params.layout.names, v, strict=True))).pieces
            v = response(method, v, inner, params, nxt_lam, config, grad_sync=sync)
        pieces = nxt_lam.layout is not None
    return v


def _hparams(problem: Problem, *, pieces: bool = False) -> tuple[list[str], Hparams]:
    """A problem's parameters as hyperparameters: replicated strategies use the module's own
    leaf parameters (its own forward then needs no rebinding, and autograd.grad never
    accumulates into them); zero3/hsdp clones of this rank's shard pieces with ``pieces``
    (bound as fast weights: each unit is gathered as its members run, and the gradients are
    pieces too), else clones of the gathered parameters, bound explicitly."""
    if problem.replicated:
        start = problem.wrapped.full_parameters()
        return list(start), Hparams(tuple(start.values()))
    if pieces:
        fast = problem.inner_params(clone=True)
        assert isinstance(fast, FastWeights)
        lam = fast_space.hparams_of(fast.requires_grad_())
        return list(fast.layout.names), lam
    whole = problem.params(clone=True)
    return list(whole), Hparams(tuple(t.requires_grad_() for t in whole.values()))


def method_of(lower: Problem, upper: Problem) -> tuple[str, HypergradConfig]:
    """The lower problem's method and its config; defaults from its optimizer's lr."""
    method = hypergradient_method(lower.config.method)
    return method.name, method.for_problem(lower, upper)


def sama_scale(problem: Problem, sgd_scale: float | None = None) -> dict[str, Tensor]:
    """SAMA's diagonal preconditioner for every trainable parameter, by name: the derivative
    of the optimizer's last update with respect to its gradient (times the lr). Adam(W):
    :func:`~metadist.meta.directional.adam_scale`; SGD: lr * (1 - dampening), or
    ``sgd_scale`` when given. Collective (sharded optimizer states are consolidated)."""
    assert problem.strategy is not None
    full = problem.strategy.optimizer_state_dict(problem.optimizer)
    assert full is not None
    params = problem.params()
    names = list(params)
    index = [i for g in full["param_groups"] for i in g["params"]]
    if len(index) != len(names):
        raise ValueError(f"method 'sama' needs problem {problem.name!r}'s optimizer to step "
                         f"exactly its {len(names)} trainable parameters, in module order; "
                         f"it steps {len(index)}")
    out: dict[str, Tensor] = {}
    for group in full["param_groups"]:
        for i in group["params"]:
            name, state = names[index.index(i)], full["state"].get(i, {})
            device = params[name].device
            if "betas" in group:
                _check_adam(problem, group)
                scale = (adam_scale(group, {k: t.to(device) for k, t in state.items()
                                            if isinstance(t, Tensor)})
                         if "exp_avg_sq" in state  # before the first step: no update yet
                         else torch.zeros_like(params[name]))
            elif "momentum" in group:
                scale = torch.full_like(params[name], _sgd_scale(group) if sgd_scale is None
                                        else sgd_scale)
            else:
                raise ValueError(f"method 'sama' knows the update of SGD, Adam and AdamW; "
                                 f"problem {problem.name!r} uses another optimizer: choose "
                                 "'darts', 'neumann' or 'cg' for it")
            out[name] = scale
    return out


def _sgd_scale(group: Mapping[str, Any]) -> float:
    """d(update)/d(gradient) of torch's SGD (after its first step), times the lr."""
    lr, mu, damp = group["lr"], group["momentum"], group.get("dampening", 0.0)
    if mu == 0:
        return float(lr)
    if group.get("nesterov", False):
        return float(lr * (1 + mu * (1 - damp)))
    return float(lr * (1 - damp))


def _check_adam(problem: Problem, group: Mapping[str, Any]) -> None:
    decoupled = (isinstance(problem.optimizer, torch.optim.AdamW)
                 or group.get("decoupled_weight_decay", False))
    coupled = group.get("weight_decay", 0.0) > 0 and not decoupled
    if coupled or group.get("amsgrad", False) or group.get("maximize", False):
        raise ValueError(f"method 'sama' differentiates Adam's plain update; problem "
                         f"{problem.name!r}'s Adam uses coupled weight_decay, amsgrad or "
                         "maximize, whose update it does not model: use AdamW (decoupled "
                         "decay) without amsgrad/maximize, or another method")


def record_last_grads(problem: Problem) -> None:
    """Keep each stepped tensor's gradient in its optimizer state (``last_grad``), as SAMA's
    Adam preconditioner needs; call right after the step, before zero_grad."""
    for group in problem.optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and problem.optimizer.state.get(p):
                problem.optimizer.state[p]["last_grad"] = p.grad.detach().clone()


def _loss_fn(engine: Engine, owner: Problem, theta_of: Problem, lam_of: Problem,
             names: list[str], *, live: bool, scale: bool) -> LossFn:
    """``owner``'s training loss with ``theta_of`` bound to theta and ``lam_of`` to lam
    (detached unless ``live``); the others run on parameters no gradient reaches."""
    def loss(theta: Any, lam: tuple[Tensor, ...] | FastWeights) -> Tensor:
        with engine._bound({theta_of.name: theta,
                            lam_of.name: _lam(lam_of, names, lam, live)}):
            out = weighted(loss_of(owner.training_step(owner.batch), owner.name),
                           owner.batch_share)
        scaler = owner.strategy.scaler if scale and owner.strategy is not None else None
        # 16-mixed: a scaled outer loss scales the hypergradient (linear in it), which keeps
        # fp16 products from underflowing; the optimizer's hook unscales and checks it.
        return scaler.scale(out) if scaler is not None else out

    return loss


def _inner_fn(engine: Engine, upper: Problem, lower: Problem, names: list[str]) -> LossFn:
    # unrolled: the k-th call replays the window's k-th step; the others: the current batch.
    steps: Iterator[list[tuple[Any, float]]] | None = (
        iter(lower._record) if lower.name in engine._replays else None)

    def inner(theta: Any, lam: tuple[Tensor, ...] | FastWeights) -> Any:
        batches = next(steps) if steps is not None else [(lower.batch, lower.batch_share)]
        with engine._bound({lower.name: theta, upper.name: _lam(upper, names, lam, True)}):
            outs = [lower.training_step(b) for b, _ in batches]
        if hypergradient_method(lower.config.method).per_sample_inner:  # not a scalar
            return _samples(outs, [w for _, w in batches], lower.name)
        losses = [weighted(loss_of(o, lower.name), w) for o, (_, w) in zip(outs, batches,
                                                                          strict=True)]
        # the mean over an accumulation's micro-batches, as the real step took it
        return sum(losses[1:], losses[0]) / len(losses) if len(losses) > 1 else losses[0]

    return inner


def _samples(outs: list[Any], shares: list[float], who: str) -> dict[str, Tensor]:
    out = outs[0]
    if len(outs) != 1 or not isinstance(out, Mapping):
        raise TypeError(f"problem {who!r} uses method 'reinforce': its training_step must "
                        "return a dict with 'loss', 'losses' (each sample's loss) and "
                        "'log_prob' (each sample's log-probability under its upper "
                        "problem's distribution)")
    share = shares[0]
    return {k: weighted(out[k], share) if k == "log_prob" else out[k]
            for k in ("losses", "log_prob") if k in out}


def _lam(upper: Problem, names: list[str], lam: tuple[Tensor, ...] | FastWeights, live: bool
         ) -> dict[str, Tensor] | FastWeights | None:
    """How the upper problem runs: its own forward when ``lam`` are its own parameters (None),
    else bound to ``lam`` (by name, or as fast weights when they are its shard pieces),
    detached unless ``live``."""
    if live and upper.replicated:
        return None
    if isinstance(lam, FastWeights):  # the upper's shard pieces (Hparams.tree())
        return lam if live else lam.detach()
    return dict(zip(names, lam if live else tuple(t.detach() for t in lam), strict=True))
