"""The multilevel engine: steps problems in dependency order, computes hypergradients that
are exact across ranks, validates on rank 0, logs, checkpoints.

``dependencies={"u2l": {upper: [lowers]}, "l2u": {lower: [uppers]}}`` (problems or names):
``u2l`` says through which lower problems an upper problem's hypergradient flows, ``l2u``
when uppers step: after each of their ``l2u`` lowers completed ``unroll_steps`` optimizer
steps. Problems no one waits for (the leaves) step every iteration.

Exactness across ranks
----------------------
Every data-dependent piece of a hypergradient (dF/dtheta, dF/dlam, each Hessian- or
mixed-vector product, each unrolled inner gradient) is averaged over ranks by
``strategy.sync_grads`` inside :func:`~metadist.meta.hypergradient`, so the result is the
single-process hypergradient of the global batch, identical on every rank. It then goes
straight into the ``.grad`` of the tensors the upper problem's optimizer steps (whole
parameters under ddp/zero1/zero2, this rank's slice of the flat shards under zero3/hsdp),
bypassing the strategy's reducer: no collective, nothing averaged twice. Lower problems train
on plain first-order gradients through ``strategy.backward``, which the reducer averages once.
Hypergradients pass through every level: an upper problem's hypergradient is the sum over
its paths (:attr:`Engine.paths`) of the chained response products, the first link on the
upper loss with its lower's method, each later link with its own problem's method on the
vector the previous one produced.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

from metadist.checkpoint import rng
from metadist.comm import ops
from metadist.comm.alone import alone
from metadist.meta.bilevel import record_last_grads, upper_gradient, weighted
from metadist.meta.config import EngineConfig
from metadist.meta.loggers import make_logger
from metadist.meta.methods import hypergradient_method
from metadist.meta.problem import Problem, loss_of
from metadist.runtime.world import init
from metadist.strategies.fast_weights import FastWeights
from metadist.strategies.registry import strategy as make_strategy

Dependencies = Mapping[str, Mapping[Problem | str, Sequence[Problem | str] | Problem | str]]
_UNSET = object()
_OWN = frozenset({"config", "problems", "world", "leaves", "u2l", "l2u", "paths",
                  "global_step",
                  "validating", "stopped_early", "last_validation", "logger"})



_VALIDATION_ALONE = (
    "In validation() every problem's module is a local copy holding the current weights: read "
    "it (or its state_dict()) directly; compute what needs every rank (a sharded optimizer's "
    "state, a collective of your own) outside validation, e.g. after engine.run()."
)

class Engine:
    """Runs ``problems`` under ``config.strategy``: ``Engine(problems, config,
    dependencies).run()``. Problems are reachable as ``engine.<name>``; override
    :meth:`validation` to evaluate every ``config.valid_step`` iterations."""

    def __init__(self, problems: Sequence[Problem], config: EngineConfig | None = None,
                 dependencies: Dependencies | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if not problems or not all(isinstance(p, Problem) for p in problems):
            raise TypeError("Engine needs a non-empty list of Problem instances (subclass "
                            "metadist.meta.Problem, implement training_step, pass instances); "
                            f"got {[type(p).__name__ for p in problems]}")
        self.problems: dict[str, Problem] = {}
        for p in problems:
            if p.name in self.problems or p.name in _OWN or hasattr(type(self), p.name):
                raise ValueError(f"problem name {p.name!r} is used twice or is an Engine "
                                 "attribute; give each problem its own name")
            self.problems[p.name] = p
        self._build_graph(dependencies)
        self.world = init()
        self.global_step = 0
        self.validating = False
        self.stopped_early = False
        self.last_validation: dict[str, Any] = {}
        self._best: float | None = None
        self._bad = 0
        self.logger = make_logger(cfg.logger_type, cfg.log_dir, self.world.rank)
        self._logging = cfg.logger_type != "none" and cfg.log_step > 0
        overridden = type(self).validation is not Engine.validation
        self._validates = cfg.valid_step > 0 and overridden
        for p in self.problems.values():
            self._set_up(p, replica=overridden and self.world.rank == 0)
        # An unbound strategy averages with 1/N; ragged shares are folded into the losses.
        data_parallel = self.world.world_size > 1
        self._sync = (make_strategy(cfg.strategy, **cfg.strategy_options).sync_grads
                      if data_parallel else None)

    def _set_up(self, p: Problem, replica: bool) -> None:
        """Set one problem up under its strategy (problems in order: what they draw from
        the global random state is drawn in that order)."""
        cfg = self.config
        if replica:
            # Before setup, while the module is whole: rank 0 validates on this copy.
            p._replica = copy.deepcopy(p.module).to(self.world.device)
        strategy = make_strategy(cfg.strategy, precision=p.config.precision or cfg.precision,
                                 **cfg.strategy_options)
        p.attach(self, strategy, cfg.seed)

    def __getattr__(self, name: str) -> Problem:
        problems: dict[str, Problem] | None = self.__dict__.get("problems")
        if name.startswith("_") or problems is None or name not in problems:
            raise AttributeError(f"'Engine' object has no attribute {name!r}")
        return problems[name]

    # ----- the graph -------------------------------------------------------------------
    def set_dependencies(self, dependencies: Dependencies) -> None:
        """Replace the dependency graph between iterations (the problems and their setups
        stay): who steps after whom and which paths each hypergradient takes from now on.
        An upper's record of which lowers completed their window starts afresh."""
        self._build_graph(dependencies)
        for p in self.problems.values():
            p._ready.clear()

    def _build_graph(self, dependencies: Dependencies | None) -> None:
        self.u2l, self.l2u = self._parse(dependencies or {})
        # the lowers an upper waits for: those that list it in l2u
        self._waits = {n: [m for m in self.problems if n in self.l2u[m]] for n in self.problems}
        self._check_graph()
        self.leaves = [p for n, p in self.problems.items() if not self._waits[n]]
        #: For each problem, its hypergradient paths: [upper, a1, ..., lower, upper] for each
        #: u2l lower and each l2u route from it up to upper (upper's loss depends on a1,
        #: a1's response on a2, ..., the lower's on upper).
        self.paths = {n: [p for lower in self.u2l[n] for p in self._routes(lower, n)]
                      for n in self.problems}
        self._replays = {n for n, p in self.problems.items()
                         if hypergradient_method(p.config.method).replays_steps
                         and any(n in path[1:-1] for paths in self.paths.values()
                                 for path in paths)}

    def _name(self, item: Problem | str, where: str) -> str:
        name = item.name if isinstance(item, Problem) else item
        if name not in self.problems:
            raise ValueError(f"dependencies[{where!r}] names {name!r}, which is not one of this "
                             f"engine's problems: {', '.join(self.problems)}")
        return name

    def _parse(self, deps: Dependencies) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        unknown = sorted(set(deps) - {"u2l", "l2u"})
        if unknown:
            raise ValueError(f"dependencies has unknown key(s) {unknown}; choose from: u2l "
                             "(upper -> lowers its hypergradient flows through), l2u (lower -> "
                             "uppers that step after its unroll window)")
        out: list[dict[str, list[str]]] = []
        for kind in ("u2l", "l2u"):
            edges: dict[str, list[str]] = {n: [] for n in self.problems}
            for key, values in deps.get(kind, {}).items():
                src = self._name(key, kind)
                for value in ([values] if isinstance(values, Problem | str) else values):
                    dst = self._name(value, kind)
                    if dst == src:
                        raise ValueError(f"dependencies[{kind!r}] links {src!r} to itself")
                    if dst not in edges[src]:
                        edges[src].append(dst)
            out.append(edges)
        return out[0], out[1]

    def _routes(self, lower: str, upper: str) -> list[list[str]]:
        """Every hypergradient path from ``upper`` through ``lower``: the l2u routes from
        ``lower`` up to ``upper``, reversed, with ``upper`` at both ends."""
        found: list[list[str]] = []

        def walk(route: list[str]) -> None:
            for nxt in self.l2u[route[-1]]:
                if nxt == upper:
                    found.append([upper, *reversed(route), upper])
                else:
                    walk([*route, nxt])

        walk([lower])
        if not found:
            raise ValueError(f"dependencies['u2l'] links {upper!r} to {lower!r}, but no "
                             f"dependencies['l2u'] route leads from {lower!r} up to "
                             f"{upper!r}; add {upper!r} to dependencies['l2u'][{lower!r}] "
                             "(or to one of its uppers')")
        return found

    def _check_graph(self) -> None:
        state: dict[str, int] = {}  # 1: on the DFS stack, 2: done

        def visit(n: str) -> None:
            state[n] = 1
            for m in self.l2u[n]:
                if state.get(m) == 1:
                    raise ValueError(f"dependencies['l2u'] has a cycle through {n!r} and {m!r}; "
                                     "lower-to-upper links must form a DAG")
                if m not in state:
                    visit(m)
            state[n] = 2

        for n in self.problems:
            if n not in state:
                visit(n)
        for upper, lowers in self.u2l.items():
            for lower in lowers:
                method = self.problems[lower].config.method
                if hypergradient_method(method).replays_steps and self.u2l[lower]:
                    raise ValueError(
                        f"problem {lower!r} has method {method!r}, which replays its plain "
                        f"gradient steps for {upper!r}; but it steps by hypergradients through "
                        f"{self.u2l[lower]}: choose 'darts', 'neumann' or 'cg' for it")

    # ----- training ------------------------------------------------------------------
    def run(self) -> None:
        """Train for ``config.train_iters`` iterations (or until early stopping, at the same
        iteration on every rank), validating, logging and checkpointing on the way."""
        cfg = self.config
        if cfg.resume_from:
            self.load_checkpoint(cfg.resume_from)
        while self.global_step < cfg.train_iters and not self.stopped_early:
            self.global_step += 1
            self.train_step()
            step = self.global_step
            if self._logging and step % cfg.log_step == 0:
                self._log_training()
            if self._validates and step % cfg.valid_step == 0:
                self.validate()
            if cfg.checkpoint_step and step % cfg.checkpoint_step == 0:
                assert cfg.checkpoint_dir is not None
                self.save_checkpoint(cfg.checkpoint_dir)

    def train_step(self) -> None:
        """One iteration: every leaf problem steps; uppers step when their lowers are ready."""
        for leaf in self.leaves:
            self._step(leaf)

    def _step(self, p: Problem) -> None:
        gas = p.config.gradient_accumulation
        if p._window >= p.config.unroll_steps and p.micro_steps % gas == 0:
            p._window = 0  # a new unroll window opens with this step
            if p.name in self._replays:
                p._theta0, p._record = p.inner_params(clone=True), []
        p.batch = p.next_batch()
        if p.name in self._replays:
            if p.micro_steps % gas == 0:
                p._record.append([])
            p._record[-1].append((p.batch, p.batch_share))
        p.micro_steps += 1
        boundary = p.micro_steps % gas == 0
        if self.u2l[p.name]:
            grads = self._hypergradient(p)
            if gas > 1:
                grads = (grads / gas if isinstance(grads, FastWeights)
                         else {n: g / gas for n, g in grads.items()})
            p.accumulate_grads(grads)
            if self._logging:
                p.last_loss = self._evaluate(p)
        else:
            with self._bound({p.name: None}):
                loss = loss_of(p.training_step(p.batch), p.name)
            if not loss.requires_grad:
                raise ValueError(f"problem {p.name!r}'s loss does not depend on its module's "
                                 "parameters; call self(...) or self.module(...) in "
                                 "training_step, outside torch.no_grad()")
            p.last_loss = loss.detach()
            self._plain_backward(p, loss, gas, boundary)
        if boundary:
            self._optimizer_step(p)

    def _plain_backward(self, p: Problem, loss: Tensor, gas: int, boundary: bool) -> None:
        """``p``'s first-order gradient of one micro-batch's ``loss`` (the mean over this
        rank's samples), averaged over ranks by the reducer at the accumulation boundary."""
        assert p.strategy is not None
        if gas > 1 or not p.replicated:
            # The reducer weights the accumulated sum by the *last* micro-batch's share;
            # with ragged batches each micro-batch needs its own, so fold it into the loss
            # and let the reducer average with 1/N. Under zero3/hsdp the problem runs on its
            # shards as fast weights, whose gathers sum the ranks' gradients before any
            # weight could apply: the share goes into the loss there too.
            loss = weighted(loss, p.batch_share) / gas
            p.strategy.set_batch_weight(1.0, float(p.strategy.world.world_size))
        with nullcontext() if boundary else p.strategy.no_sync(p.wrapped):
            # Only this problem's parameters: the others' ran on their own parameters too.
            p.strategy.backward(loss, inputs=p.trainable())

    def _optimizer_step(self, p: Problem) -> None:
        assert p.strategy is not None
        if p.config.gradient_clipping is not None:
            p.strategy.clip_grad_norm_(p.wrapped, p.config.gradient_clipping)
        p.optimizer.step()
        if hypergradient_method(p.config.method).keeps_last_grads:
            record_last_grads(p)
        if p.scheduler is not None:
            p.scheduler.step()
        p.optimizer.zero_grad(set_to_none=True)
        p.steps += 1
        p._window += 1
        if p._window != p.config.unroll_steps:
            return
        for name in self.l2u[p.name]:
            upper = self.problems[name]
            upper._ready.add(p.name)
            if upper._ready.issuperset(self._waits[name]):
                upper._ready.clear()
                self._step(upper)

    @contextmanager
    def _bound(self, explicit: Mapping[str, Mapping[str, Tensor] | FastWeights | None]
               ) -> Iterator[None]:
        """Within: problem ``n`` runs on ``explicit[n]`` (``None``: on its own parameters), and
        every other problem on parameters no gradient may reach: its own, untouched, for
        replicated strategies (callers differentiate only with respect to what they train:
        ``autograd.grad`` or ``backward(inputs=...)``, so nothing accumulates there), and
        detached full copies under zero3/hsdp (whose own forward would gather shards into a
        graph).

        The tensors are bound into each problem's user module for the whole block
        (:meth:`DistributedModule.bound`), not into one call: whatever path the problem's
        code takes to a module, its own or another problem's (``self(x)``, ``self.module(x)``,
        a method such as ``self.module.loss(...)``, an attribute, ``named_parameters()``,
        ``state_dict()``), it reads the tensors bound here, as Betty's in-place perturbation
        of the real parameters would show them. Under zero3/hsdp a problem on its own
        parameters is bound to its shards as fast weights (``fast_weights()``, differentiable
        into the shards): each unit is gathered as its members run, and a read outside a
        unit's forward gathers that unit, so no rank holds the whole model. Each binding marks
        only its own module as running on explicit parameters. Blocks nest."""
        with ExitStack() as stack:
            for name, problem in self.problems.items():
                params = explicit.get(name, _UNSET)
                if problem.replicated and (params is None or params is _UNSET):
                    continue  # its own parameters, which its module holds
                if params is None:  # zero3/hsdp: its shards as fast weights, differentiable
                    params = problem.wrapped.fast_weights()
                elif params is _UNSET:  # zero3/hsdp: detached shard pieces, not whole copies
                    params = problem.inner_params()
                stack.enter_context(problem.bound(params))  # type: ignore[arg-type]
            yield

    def _hypergradient(self, upper: Problem) -> dict[str, Tensor] | FastWeights:
        return upper_gradient(self, upper)

    def _evaluate(self, p: Problem) -> Tensor:
        with torch.no_grad(), self._bound({}):
            return loss_of(p.training_step(p.batch), p.name).detach()

    # ----- validation, logging, checkpoints -----------------------------------------------
    def validation(self) -> Mapping[str, Any] | None:
        """Override to evaluate: called on rank 0 only, every ``config.valid_step``
        iterations, with every problem's module replaced by a local replica holding the
        current weights (so nothing here communicates). Return metrics by name."""
        return None

    # [Note: random draws in validation]
    # validation() runs on rank 0 alone, and what it draws (a DataLoader's iter() draws its
    # base seed, dropout in a model left in train mode, a random crop) moves rank 0's
    # generators only. One process continues from the moved state, so each generator of a
    # rank (torch's, Python's, numpy's, CUDA's) that was rank 0's before validation takes
    # rank 0's after it; one seeded apart (its own stream on purpose) keeps its own.
    def validate(self) -> None:
        """One validation round now (collective: call it on every rank; :meth:`run` calls it
        every ``valid_step`` iterations). Results land in ``last_validation`` on every rank."""
        # Collective part first, on every rank: each problem's full state (a gather under
        # zero3). Then rank 0 loads it into its replicas and validates alone.
        states = [p.wrapped.state_dict() for p in self.problems.values()]
        metrics: dict[str, float] = {}
        error: str | None = None
        before = rng.digests(rng.capture()) if self.world.world_size > 1 else {}
        if self.world.rank == 0:
            replicas = [(r, r.training) for p in self.problems.values()
                        if (r := p._replica) is not None]
            self.validating = True
            try:
                for p, state in zip(self.problems.values(), states, strict=True):
                    if p._replica is not None:
                        p._replica.load_state_dict(state)
                        p._replica.eval()
                with alone("validation(), which runs on rank 0 only", _VALIDATION_ALONE):
                    metrics = self._validation_metrics(self.validation() or {})
            except Exception:  # every rank must learn of it, not wait forever
                error = traceback.format_exc()
            finally:
                self.validating = False
                for r, mode in replicas:
                    r.train(mode)
        if self.world.world_size > 1:
            after = rng.capture() if self.world.rank == 0 else None
            metrics, error, (before_0, after_0) = ops.broadcast_object(
                (metrics, error, (before, after)), 0)
            if self.world.rank != 0:  # [Note: random draws in validation]
                rng.restore({k: v for k, v in after_0.items()
                             if k in before and before[k] == before_0.get(k)})
        if error is not None:
            raise RuntimeError(f"validation() failed on rank 0 at iteration "
                               f"{self.global_step}:\n{error}")
        self.last_validation = metrics
        self.logger.log(metrics, "validation", self.global_step)
        if self.config.early_stopping is not None:
            # Every rank applies the same rule to the same broadcast numbers: same decision.
            self.stopped_early = self._no_improvement(metrics)
            if self.stopped_early:
                self.logger.log({"iteration": float(self.global_step)}, "early_stopping",
                                self.global_step)

    def _validation_metrics(self, returned: Mapping[str, Any]) -> dict[str, Any]:
        """What ``validation()`` returned, as the metrics kept and logged: numbers."""
        return {k: float(v) for k, v in returned.items()}

    def _no_improvement(self, metrics: Mapping[str, Any]) -> bool:
        rule = self.config.early_stopping
        assert rule is not None
        if rule.metric not in metrics:
            raise KeyError(f"early stopping watches {rule.metric!r}, but validation() returned "
                           f"{sorted(metrics)}; return it or set EarlyStopping(metric=...)")
        value = metrics[rule.metric]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"early stopping watches {rule.metric!r}, which validation() "
                            f"returned as {type(value).__name__} ({value!r}); return a number")
        best = self._best
        better = best is None or (value < best - rule.min_delta if rule.mode == "min"
                                  else value > best + rule.min_delta)
        self._best, self._bad = (value, 0) if better else (best, self._bad + 1)
        return self._bad >= rule.patience

    def _log_training(self) -> None:
        stepped = [p for p in self.problems.values() if p.last_loss is not None]
        if not stepped:
            return
        strategy = stepped[0].strategy
        assert strategy is not None
        losses = torch.stack([p.last_loss.float().to(strategy.device)  # type: ignore[union-attr]
                              for p in stepped])
        mean = strategy.all_reduce(losses, "mean").tolist()
        self.logger.log({f"{p.name}/loss": v for p, v in zip(stepped, mean, strict=True)},
                        "train", self.global_step)

    def _checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for n, p in self.problems.items():
            assert p.strategy is not None
            state.update({f"{n}.module": p.wrapped, f"{n}.optimizer": p.optimizer,
                          f"{n}.scheduler": p.scheduler, f"{n}.scaler": p.strategy.scaler,
                          f"{n}.loader": p.train_data_loader
                          if hasattr(p.train_data_loader, "state_dict") else None})
        state["engine"] = {"global_step": self.global_step, "best": self._best,
                           "bad": self._bad,
                           "steps": {n: [p.steps, p.micro_steps]
                                     for n, p in self.problems.items()}}
        return state

    def save_checkpoint(self, path: str) -> None:
        """Save every problem's module, optimizer, scheduler, scaler and data position, and
        the engine's counters (collective). Open unroll windows and partly accumulated
        gradients are not saved: a resumed run opens fresh windows."""
        first = next(iter(self.problems.values())).strategy
        assert first is not None
        first.save(path, self._checkpoint_state(), format=self.config.checkpoint_format)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (collective)."""
        first = next(iter(self.problems.values())).strategy
        assert first is not None
        plain = first.load(path, self._checkpoint_state())["engine"]
        self.global_step, self._best, self._bad = plain["global_step"], plain["best"], plain["bad"]
        for n, p in self.problems.items():
            p.steps, p.micro_steps = plain["steps"][n]
            p._iterator = None  # the next batch comes from the restored loader position
            p._window, p._ready = p.config.unroll_steps, set()
