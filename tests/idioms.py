"""Meta-learning idioms as a user would write them, each run through a strategy on N ranks and
as one plain PyTorch process: the "same code, same result under every strategy" matrix
(tests/test_same_code.py).

Every body takes ``(strategy, options)``, trains >= 10 outer steps on this rank's contiguous
slice of the tasks or batch and returns the final parameters by the user's module's names.
:func:`all_idioms_on_rank` runs every idiom in one pool round-trip and turns an idiom's
exception into a :class:`Failure`, so one idiom's documented error does not hide the others'
results. That is only safe for errors every rank raises at the same point (before the ranks'
collectives diverge); an error raised on one rank only shows up as a hang (the pool timeout).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

import metadist
from meta import (
    PENALTY,
    _regression,
    _small_net,
    hyper_on_rank,
    hyper_reference,
    penalty_on_rank,
    penalty_reference,
    sinusoid_tasks,
)
from metadist.meta import (
    MetaAdam,
    MetaAdamW,
    MetaOptimizer,
    MetaSGD,
    extract_state_dict,
    module_clone,
    recover_state_dict,
)
from metadist.strategies import DistributedModule
from parity import loss_fn, shard

Params = dict[str, Tensor]
Task = tuple[Tensor, ...]
# The per-rank objective of one outer step: (wrapped model, this rank's tasks) -> mean loss.
Objective = Callable[[DistributedModule, list[Task]], Tensor]


class Failure(NamedTuple):
    """An idiom that raised: ``("error", type name, message, traceback top)``."""

    kind: str
    type: str
    message: str
    where: str


def _final(model: DistributedModule) -> Params:
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


# ----- second-order MAML: the ways to write the inner loop -------------------------------------
# Smaller than tests/meta.py's MAML (whose 1-40-40-1 net and 12 tasks cost seconds per run):
# every idiom runs in every cell of the matrix.
TASKS, SHOTS, INNER_STEPS, INNER_LR, OUTER_STEPS = 6, 5, 3, 0.1, 10


def maml_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))  # tanh: 2nd order matters


def maml_tasks(step: int) -> list[Task]:
    return sinusoid_tasks(step, k=SHOTS)[:TASKS]


def _adapt(forward: Callable[[Params, Tensor], Tensor], params: Params, x: Tensor,
           y: Tensor) -> Params:
    for _ in range(INNER_STEPS):
        grads = torch.autograd.grad(loss_fn(forward(params, x), y), list(params.values()),
                                    create_graph=True)
        params = {n: p - INNER_LR * g for (n, p), g in zip(params.items(), grads, strict=True)}
    return params


# The inner Adam/AdamW of the MetaAdam/MetaAdamW clone idioms, and its hyperparameters.
ADAM_LR, BETAS, EPS, DECAY = 0.03, (0.9, 0.999), 1e-8, 0.01


def _adapt_adam(decoupled: bool) -> Callable[[Callable[[Params, Tensor], Tensor], Params,
                                              Tensor, Tensor], Params]:
    """torch.optim.Adam's (``decoupled``: AdamW's) update written out in plain tensor algebra,
    kept in the graph: the reference the MetaAdam/MetaAdamW idioms must reproduce."""
    def adapt(forward: Callable[[Params, Tensor], Tensor], params: Params, x: Tensor,
              y: Tensor) -> Params:
        (b1, b2), m, v = BETAS, {n: torch.zeros_like(p) for n, p in params.items()}, {
            n: torch.zeros_like(p) for n, p in params.items()}
        for t in range(1, INNER_STEPS + 1):
            grads = dict(zip(params, torch.autograd.grad(
                loss_fn(forward(params, x), y), list(params.values()), create_graph=True),
                strict=True))
            new = {}
            for n, p in params.items():
                g = grads[n] if decoupled else grads[n] + DECAY * p
                start = p * (1 - ADAM_LR * DECAY) if decoupled else p
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                denom = v[n].sqrt() / (1 - b2**t) ** 0.5 + EPS
                new[n] = start - ADAM_LR / (1 - b1**t) * m[n] / denom
            params = new
        return params

    return adapt


INNER: dict[str, Callable[[Callable[[Params, Tensor], Tensor], Params, Tensor, Tensor],
                          Params]] = {
    "sgd": _adapt, "adam": _adapt_adam(decoupled=False), "adamw": _adapt_adam(decoupled=True)}


def maml_reference(inner: str = "sgd") -> Params:
    """One process, every task: the result the MAML idioms must reproduce (``inner``: the
    inner loop's optimiser, written out in plain PyTorch)."""
    net = maml_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)

    def forward(params: Params, x: Tensor) -> Tensor:
        return functional_call(net, params, (x,))

    for step in range(OUTER_STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        for xs, ys, xq, yq in maml_tasks(step):
            fast = INNER[inner](forward, dict(net.named_parameters()), xs, ys)
            total = total + loss_fn(forward(fast, xq), yq) / TASKS
        total.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _maml(strategy: str, options: dict[str, Any], objective: Objective) -> Params:
    """MAML through ``strategy`` on this rank's tasks, with a pluggable per-rank objective."""
    w = metadist.world()
    net = maml_net()
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    per = TASKS // w.world_size
    for step in range(OUTER_STEPS):
        opt.zero_grad()
        s.backward(objective(model, maml_tasks(step)[w.rank * per:(w.rank + 1) * per]))
        opt.step()
    return _final(model)


def _mean_query(query: Callable[[DistributedModule, Task], Tensor]) -> Objective:
    def objective(model: DistributedModule, tasks: list[Task]) -> Tensor:
        return sum((query(model, t) for t in tasks), torch.zeros(())) / len(tasks)
    return objective


def _query_via_functional_call(model: DistributedModule, params: Params, task: Task) -> Tensor:
    xs, ys, xq, yq = task

    def forward(p: Params, x: Tensor) -> Tensor:
        return functional_call(model, p, (x,))

    return loss_fn(forward(_adapt(forward, params, xs, ys), xq), yq)


def maml_functional_call(strategy: str, options: dict[str, Any]) -> Params:
    """torch.func.functional_call on the wrapped model with its own ``named_parameters()``:
    under sharding strategies those are the shards, which the forward does not read."""
    return _maml(strategy, options, _mean_query(
        lambda m, t: _query_via_functional_call(m, dict(m.named_parameters()), t)))


def maml_functional_call_full(strategy: str, options: dict[str, Any]) -> Params:
    """The same with the full parameters under the wrapper's names (``module.`` + name)."""
    return _maml(strategy, options, _mean_query(lambda m, t: _query_via_functional_call(
        m, {"module." + n: p for n, p in m.full_parameters().items()}, t)))


def _query_via_functional_forward(model: DistributedModule, task: Task) -> Tensor:
    xs, ys, xq, yq = task
    fast = _adapt(model.functional_forward, model.full_parameters(), xs, ys)
    return loss_fn(model.functional_forward(fast, xq), yq)


def maml_full_parameters(strategy: str, options: dict[str, Any]) -> Params:
    """``full_parameters()`` + ``functional_forward`` (tests/meta.py's portable form)."""
    return _maml(strategy, options, _mean_query(_query_via_functional_forward))


def _query_via_clone(make: Callable[[nn.Module], MetaOptimizer]
                     ) -> Callable[[DistributedModule, Task], Tensor]:
    def query(model: DistributedModule, task: Task) -> Tensor:
        xs, ys, xq, yq = task
        clone = module_clone(model, by="copy")
        inner = make(clone)
        for _ in range(INNER_STEPS):
            inner.step(loss_fn(clone(xs), ys))
        return loss_fn(clone(xq), yq)

    return query


def maml_module_clone(strategy: str, options: dict[str, Any]) -> Params:
    """A graph-connected clone of the wrapped model per task, stepped by MetaSGD (plain
    differentiable SGD: the reference's inner step)."""
    return _maml(strategy, options, _mean_query(_query_via_clone(
        lambda clone: MetaSGD(clone, INNER_LR))))


def maml_module_clone_adam(strategy: str, options: dict[str, Any]) -> Params:
    """The same clone stepped by MetaAdam (coupled weight decay)."""
    return _maml(strategy, options, _mean_query(_query_via_clone(
        lambda clone: MetaAdam(clone, ADAM_LR, BETAS, EPS, weight_decay=DECAY))))


def maml_module_clone_adamw(strategy: str, options: dict[str, Any]) -> Params:
    """The same clone stepped by MetaAdamW (decoupled weight decay)."""
    return _maml(strategy, options, _mean_query(_query_via_clone(
        lambda clone: MetaAdamW(clone, ADAM_LR, BETAS, EPS, weight_decay=DECAY))))


def _query_in_place(model: DistributedModule, task: Task) -> Tensor:
    xs, ys, xq, yq = task
    saved = extract_state_dict(model)  # the wrapped model's own parameters, by reference
    inner = MetaSGD(model, INNER_LR)
    for _ in range(INNER_STEPS):
        inner.step(loss_fn(model(xs), ys))
    query = loss_fn(model(xq), yq)
    recover_state_dict(model, saved)  # the next task starts from the real parameters
    return query


def maml_meta_sgd_in_place(strategy: str, options: dict[str, Any]) -> Params:
    """TorchOpt's idiom: MetaSGD bound to the wrapped model itself, its parameters taken with
    extract_state_dict and put back with recover_state_dict after each task. Under sharding
    strategies the wrapped model holds shards: refused."""
    return _maml(strategy, options, _mean_query(_query_in_place))


def _vmapped_tasks(model: DistributedModule, tasks: list[Task]) -> Tensor:
    def task_loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(model.functional_forward(p, x), y)

    def adapted_query(p: Params, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> Tensor:
        for _ in range(INNER_STEPS):
            g = torch.func.grad(task_loss)(p, xs, ys)
            p = {n: p[n] - INNER_LR * g[n] for n in p}
        return task_loss(p, xq, yq)

    stacked = [torch.stack(column) for column in zip(*tasks, strict=True)]
    losses = torch.func.vmap(adapted_query, in_dims=(None, 0, 0, 0, 0))(
        model.full_parameters(), *stacked)
    return losses.mean()


def maml_torch_func(strategy: str, options: dict[str, Any]) -> Params:
    """torch.func.grad for the inner gradient, torch.func.vmap over this rank's tasks."""
    return _maml(strategy, options, _vmapped_tasks)


# ----- gradient-norm penalty --------------------------------------------------------------------

def _penalty(strategy: str, options: dict[str, Any],
             objective: Callable[[DistributedModule, Tensor, Tensor], Tensor]) -> Params:
    """tests/meta.py's penalty setup (net, batches, Adam) with a pluggable per-rank objective."""
    w = metadist.world()
    net = _small_net()
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    for x, y in _regression():
        opt.zero_grad()
        s.backward(objective(model, shard(x, w.rank, w.world_size),
                             shard(y, w.rank, w.world_size)))
        opt.step()
    return _final(model)


def _penalized(loss: Tensor, params: Sequence[Tensor]) -> Tensor:
    grads = torch.autograd.grad(loss, list(params), create_graph=True)
    return loss + PENALTY * sum((g**2).sum() for g in grads)


def penalty_usual(strategy: str, options: dict[str, Any]) -> Params:
    """``autograd.grad`` with respect to ``model.parameters()``: this rank's gradient under
    replicating strategies; under sharding ones those parameters are shards."""
    return _penalty(strategy, options,
                    lambda m, x, y: _penalized(loss_fn(m(x), y), list(m.parameters())))


def _portable(model: DistributedModule, x: Tensor, y: Tensor) -> Tensor:
    params = model.full_parameters()
    return _penalized(loss_fn(model.functional_forward(params, x), y), list(params.values()))


def penalty_local_portable(strategy: str, options: dict[str, Any]) -> Params:
    """The same per-rank objective through ``full_parameters`` + ``functional_forward``."""
    return _penalty(strategy, options, _portable)


def penalty_local_reference(world: int) -> Params:
    """One process: the mean over the ranks' slices of [loss_r + PENALTY * |grad loss_r|^2],
    what the strategy's gradient averaging makes of a per-rank penalty."""
    net = _small_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for x, y in _regression():
        opt.zero_grad()
        total = torch.zeros(())
        for r in range(world):
            loss = loss_fn(net(shard(x, r, world)), shard(y, r, world))
            total = total + _penalized(loss, list(net.parameters())) / world
        total.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def penalty_global(strategy: str, options: dict[str, Any]) -> Params:
    """The gradient of the global loss via ``strategy.sync_grads`` (tests/meta.py)."""
    return penalty_on_rank(strategy, options)


def unrolled_hypergradient(strategy: str, options: dict[str, Any]
                           ) -> tuple[Params, float, list[float]]:
    """tests/meta.py's hypergradient through one unrolled step: (params, decay, hypers)."""
    return hyper_on_rank(strategy, options)


# ----- the matrix -------------------------------------------------------------------------------

IDIOMS: dict[str, Callable[[str, dict[str, Any]], Any]] = {
    "maml_functional_call": maml_functional_call,
    "maml_functional_call_full": maml_functional_call_full,
    "maml_full_parameters": maml_full_parameters,
    "maml_module_clone": maml_module_clone,
    "maml_module_clone_adam": maml_module_clone_adam,
    "maml_module_clone_adamw": maml_module_clone_adamw,
    "maml_meta_sgd_in_place": maml_meta_sgd_in_place,
    "maml_torch_func": maml_torch_func,
    "penalty_usual": penalty_usual,
    "penalty_local_portable": penalty_local_portable,
    "penalty_global": penalty_global,
    "unrolled_hypergradient": unrolled_hypergradient,
}


def reference(idiom: str, world: int) -> Any:
    """The single-process result ``idiom`` must match on ``world`` ranks."""
    if idiom.startswith("maml_"):
        return maml_reference(idiom.removeprefix("maml_module_clone_")
                              if idiom.startswith("maml_module_clone_") else "sgd")
    if idiom in ("penalty_usual", "penalty_local_portable"):
        return penalty_local_reference(world)
    if idiom == "penalty_global":
        return penalty_reference()
    if idiom == "unrolled_hypergradient":
        return hyper_reference()
    raise KeyError(idiom)


def _where(exc: BaseException) -> str:
    """The innermost frames of the traceback: where the error was raised."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                       for f in reversed(frames))


def all_idioms_on_rank(strategy: str, options: dict[str, Any],
                       idioms: Sequence[str] | None = None) -> dict[str, Any]:
    """Every idiom in turn (a fresh model and strategy each): result or :class:`Failure`."""
    out: dict[str, Any] = {}
    for name in idioms or IDIOMS:
        try:
            out[name] = IDIOMS[name](strategy, options)
        except Exception as exc:  # reported per idiom, asserted by the test
            out[name] = Failure("error", type(exc).__name__, str(exc), _where(exc))
    return out
