"""Betty's hypergradient: the upper loss's direct gradient plus, when the upper problem's
``first_order`` is True, one term per path [upper, a1, ..., upper]: dF/d(a1's parameters),
carried down the path by each problem's best-response product (its ``Config.type``).

Each product is the response product of the registered metadist method (meta/methods.py)
that computes Betty's (:data:`BETTY_TYPES`); every data-dependent piece is synced over ranks, so the
result is the one-process value of the global batch at any world size. Betty's types:

* ``darts``: -M.v by a central finite difference with eps = darts_alpha / |v| (metadist's
  ``sama`` with the identity preconditioner; not metadist's ``darts``, DARTS' virtual step).
* ``sama``: -M.(P v), P the derivative of Adam's last update (times its lr), identity for
  other optimizers, radius ``sama_adam_alpha``.
* ``neumann``: -M.(neumann_alpha * sum_k (I - neumann_alpha H)^k v), ``neumann_iterations``.
* ``cg``: -M.x, x from Betty 0.2.1's ``cg_iterations`` steps on H x = v (:func:`_betty_cg`:
  step sizes divided by ``cg_alpha``, directions from the previous residual; textbook CG
  only at one iteration). metadist's own ``method="cg"`` is textbook CG.
* ``reinforce`` (a stub in Betty 0.2.1): metadist's score-function estimator, radius
  ``darts_alpha``, unscaled like Betty's darts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from metadist.meta import fast_space
from metadist.meta.bilevel import _hparams, _inner_fn, _lam, sama_scale, weighted
from metadist.meta.directional import ReinforceConfig, SamaConfig
from metadist.meta.fast_space import Hparams
from metadist.meta.hypergrad import CGConfig, HypergradConfig, NeumannConfig
from metadist.meta.hypergrad import _dot as dot  # over every shard when theta is pieces
from metadist.meta.methods import Solve, Vec, hypergradient_method
from metadist.meta.problem import loss_of
from metadist.strategies.fast_weights import FastWeights

if TYPE_CHECKING:
    from metadist.compat.betty.configs import Config as BettyConfig
    from metadist.compat.betty.engine import Engine
    from metadist.compat.betty.problems import Problem


@dataclass(frozen=True)
class BettyType:
    """How one of Betty's ``Config.type`` values is computed: by the registered metadist
    method ``method`` (meta/methods.py) with the config ``config`` builds from the problem,
    and ``solve`` (from the problem's Config) replacing that method's inverse-Hessian solve."""

    method: str
    config: Callable[[Problem], HypergradConfig]
    solve: Callable[[BettyConfig], Solve] | None = None


def _betty_sama(curr: Problem) -> SamaConfig:
    return SamaConfig(r=curr.config.sama_adam_alpha, scale=sama_scale(curr, sgd_scale=1.0))


#: Betty's types, in the order its errors list them.
BETTY_TYPES: dict[str, BettyType] = {
    "darts": BettyType("sama", lambda curr: SamaConfig(r=curr.config.darts_alpha)),
    "sama": BettyType("sama", _betty_sama),
    "neumann": BettyType("neumann", lambda curr: NeumannConfig(
        iterations=curr.config.neumann_iterations, alpha=curr.config.neumann_alpha)),
    # run by _betty_cg below; the config only names the method
    "cg": BettyType("cg", lambda curr: CGConfig(iterations=curr.config.cg_iterations, tol=0.0),
                    solve=lambda cfg: _betty_cg(cfg.cg_iterations, cfg.cg_alpha)),
    "reinforce": BettyType("reinforce",
                           lambda curr: ReinforceConfig(xi=1.0, r=curr.config.darts_alpha)),
}


def link_method(curr: Problem) -> tuple[str, HypergradConfig]:
    """metadist's method and config computing Betty's product of ``curr``'s type."""
    kind = BETTY_TYPES[curr.config.type]  # Config validated the type
    return kind.method, kind.config(curr)


def upper_gradient(engine: Engine, upper: Problem
                   ) -> tuple[dict[str, Tensor] | FastWeights, Any]:
    """(d upper-loss / d upper-parameters, synced; what training_step returned). Under
    "fsdp" it is taken with respect to the upper problem's shard pieces and returned as fast
    weights of them (no rank holds the upper model whole); by name otherwise. The lower
    problems the direct term binds live (``first_order`` paths) are pieces too."""
    names, lam = _hparams(upper, pieces=True)
    firsts = list(dict.fromkeys(path[1] for path in upper.paths)) if upper.config.first_order \
        else []
    live = {p.name: _hparams(p, pieces=True) for p in firsts}
    bound = {upper.name: _lam(upper, names, lam.tree(), True)}
    bound.update({n: _lam(engine.problems[n], live[n][0], live[n][1].tree(), True)
                  for n in live})
    with engine._bound(bound):
        out = upper.training_step(upper.batch)
    loss = weighted(loss_of(out, upper.name), upper.batch_share)
    scaler = upper.strategy.scaler if upper.strategy is not None else None
    if scaler is not None:
        loss = scaler.scale(loss)  # as metadist's engine: the optimizer's hook unscales
    inputs = [*lam, *(t for n in live for t in live[n][1])]

    def take() -> tuple[Tensor | None, ...]:
        return torch.autograd.grad(loss, inputs, allow_unused=True)

    if lam.layout is not None:  # pieces: what was not reached, from the gathers' record
        grads, unused = lam.layout.unreached(take)
    else:
        grads = take()
        unused = [n for n, g in zip(names, grads, strict=False) if g is None]
    if unused and not upper.config.allow_unused:
        raise ValueError(f"problem {upper.name!r}: its loss does not depend on parameter(s) "
                         f"{unused} (Config(allow_unused=False)); use them, or set "
                         "allow_unused=True")
    dense = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]
    sync, sets = engine._sync, [lam, *(live[n][1] for n in live)]
    synced: list[Tensor]
    if all(h.layout is None for h in sets):  # one collective for every whole gradient
        synced = list(sync(tuple(dense))) if sync is not None else dense
    else:  # pieces are averaged as pieces (never with another rank's shard)
        synced, start = [], 0
        for h in sets:
            synced += fast_space.sync_lam(sync, dense[start:start + len(h)], h)
            start += len(h)
    total, start = synced[:len(lam)], len(lam)
    first_v: dict[str, tuple[Tensor, ...]] = {}
    for n in live:
        first_v[n] = tuple(synced[start:start + len(live[n][1])])
        start += len(live[n][1])
    for path in upper.paths if upper.config.first_order else []:
        first = live[path[1].name]
        v, v_names, pieces = first_v[path[1].name], first[0], first[1].layout is not None
        for i in range(1, len(path) - 1):
            v, v_names, pieces = _link(engine, upper, names, lam, path[i], path[i + 1],
                                       (v, v_names, pieces))
        total = [a + b for a, b in zip(total, v, strict=True)]
    if lam.layout is not None:
        return FastWeights(lam.layout, tuple(total)), out
    return dict(zip(names, total, strict=True)), out


def _link(engine: Engine, upper: Problem, names: list[str], lam: Hparams,
          curr: Problem, nxt: Problem, v: tuple[tuple[Tensor, ...], list[str], bool]
          ) -> tuple[tuple[Tensor, ...], list[str], bool]:
    """``curr``'s response product of ``v`` (the vector, its names, whether it is pieces of
    ``curr``'s shards, else whole by name): the vector with respect to ``nxt``'s
    parameters, the same way. Under zero3/hsdp the products run on ``curr``'s shards as
    fast weights, and ``nxt``'s parameters are its shard pieces."""
    nxt_names, nxt_lam = (names, lam) if nxt is upper else _hparams(nxt, pieces=True)
    kind = BETTY_TYPES[curr.config.type]
    params = curr.inner_params(clone=not curr.replicated)
    vec, v_names, pieces = v
    if isinstance(params, FastWeights) and not pieces:
        vec = params.like(dict(zip(v_names, vec, strict=True))).pieces
    solve = kind.solve(curr.config) if kind.solve is not None else None
    out = hypergradient_method(kind.method).response(
        vec, _inner_fn(engine, nxt, curr, nxt_names), params, nxt_lam, kind.config(curr),
        grad_sync=engine._sync, solve=solve)
    return out, nxt_names, nxt_lam.layout is not None


def _betty_cg(iterations: int, alpha: float) -> Solve:
    """Betty 0.2.1's conjugate gradient for H x = v: step a = r.r / (alpha p.Hp), residual
    r' = r - a Hp, direction r + (r'.r' / r.r) p (the previous residual, where textbook CG
    uses r'), result alpha x. One iteration equals textbook CG for any alpha."""
    def solve(hvp: Callable[[Vec], Vec], v: Vec) -> Vec:
        x, r, p = [torch.zeros_like(t) for t in v], list(v), list(v)
        for _ in range(iterations):
            hp = hvp(p)
            rr = dot(r, r)
            a = rr / (alpha * dot(hp, p))
            x = [xi + a * pi for xi, pi in zip(x, p, strict=True)]
            r_new = [ri - a * hi for ri, hi in zip(r, hp, strict=True)]
            beta = dot(r_new, r_new) / rr
            # Betty 0.2.1 builds the next direction from the *previous* residual
            p = [ri + beta * pi for ri, pi in zip(r, p, strict=True)]
            r = r_new
        return [alpha * xi for xi in x]

    return solve
