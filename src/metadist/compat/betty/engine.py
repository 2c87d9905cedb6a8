"""Betty's ``betty.engine.Engine`` on metadist's Engine.

Betty's schedule, step for step: leaves step every iteration; a problem whose lower problems
all finished ``unroll_steps * gradient_accumulation`` micro-steps (after ``warmup_steps``)
steps next; each step runs ``on_inner_loop_start`` (at a window's start), Betty's loss
(divided by ``gradient_accumulation``), ``grad_callback``, the optimizer at accumulation
boundaries (``custom_optimizer_step`` when defined, clipping when ``gradient_clipping`` >
0), ``param_callback``, and the LR scheduler on *every* micro-step, as Betty does. With
``roll_back`` a lower problem returns to its window's start after its uppers stepped and
retakes one step on its last batch. Each step goes through the problem's
``one_step_descent`` and ``optimizer_step``, so a subclass's overrides of them run where
Betty runs them; an override of ``backward``, ``step_normal`` or ``step_after_roll_back``
is refused when the engine is built (the drop-in has no such step to replace).

A DataLoader's ``batch_size`` is per rank, as in Betty's distributed mode: N ranks read the
global batch of N x batch_size consecutive samples that one process with batch_size
N x batch_size reads. What differs from Betty, on purpose: every hypergradient piece is
averaged over ranks (Betty averages only the last one), so N ranks compute exactly what that
one process computes; validation and early stopping decide on rank 0 and every rank follows.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from metadist.compat.betty.configs import EngineConfig
from metadist.compat.betty.hypergradient import upper_gradient
from metadist.compat.betty.logging import get_logger
from metadist.compat.betty.logging import logger as make_logger
from metadist.compat.betty.problems import IterativeProblem, Problem
from metadist.meta.bilevel import record_last_grads
from metadist.meta.config import EarlyStopping
from metadist.meta.config import EngineConfig as NativeConfig
from metadist.meta.engine import Engine as NativeEngine
from metadist.strategies.fast_weights import FastWeights

_warned_batchnorm = False  # the warning below is said once per process


#: Betty's Problem methods a subclass may override that the drop-in has no counterpart to
_NOT_CALLED = {
    "backward": "the direct and best-response gradients",
    "step_normal": "the unrolling and the uppers' steps",
    "step_after_roll_back": "the steps after a roll_back",
}


def _log_line(stats: Mapping[str, Any]) -> str:
    """Betty's rendering of a stats dict: ``key: value`` joined by `` || ``, a list's (or
    dict's) entries as ``key_i``."""
    def plain(v: Any) -> Any:
        return v.item() if isinstance(v, Tensor) else v

    out: list[str] = []
    for key, value in stats.items():
        if isinstance(value, dict | list):
            out.extend(f"{key}_{i}: {plain(v)}" for i, v in enumerate(value))
        else:
            out.append(f"{key}: {plain(value)}")
    return " || ".join(out)


def _native(config: EngineConfig) -> NativeConfig:
    stopping = (EarlyStopping(metric=config.early_stopping_metric,
                              mode=config.early_stopping_mode,
                              patience=config.early_stopping_tolerance)
                if config.early_stopping else None)
    # Betty's DDP normalises each rank's batch alone: its BatchNorm, unless the program says
    # otherwise (the engine warns once that it differs from one process)
    options = {"sync_batchnorm": False, **config.strategy_options}
    return NativeConfig(strategy=config.strategy, strategy_options=options,
                        train_iters=config.train_iters, valid_step=config.valid_step,
                        early_stopping=stopping, logger_type="none", log_step=0)


class Engine(NativeEngine):
    """``Engine(problems, config=None, dependencies=None, env=None)``, as Betty's."""

    def __init__(self, problems: Sequence[Problem], config: EngineConfig | None = None,
                 dependencies: Mapping[str, Any] | None = None, env: Any = None) -> None:
        self.betty_config = config if config is not None else EngineConfig()
        self.dependencies = dependencies or {"u2l": {}, "l2u": {}}
        self.env = env
        self.train_iters = self.betty_config.train_iters
        self.valid_step = self.betty_config.valid_step
        self._roll_back = self.betty_config.roll_back
        betty_logger = make_logger(self.betty_config.logger_type)
        self._link(list(problems))
        # each problem is initialised and set up in turn (_set_up), as Betty does
        super().__init__(list(problems), _native(self.betty_config), self.dependencies)
        self.logger = betty_logger  # Betty's: log(stats, tag, step) and info/warning
        self.device = self.world.device
        for p in problems:
            p.add_logger(betty_logger)
            p._roll_back = self._roll_back and bool(p.parents)
            if env is not None:
                setattr(env, p.name, p)
        if env is not None:
            env.configure_distributed_training({
                "strategy": self.config.strategy, "backend": self.world.backend,
                "world_size": self.world.world_size, "rank": self.world.rank,
                "local_rank": self.world.local_rank})
            env.configure_device(self.device)
            env.initialize()
            for p in problems:
                p.add_env(env)
        self._check_methods(list(problems))
        self._warn_unsynchronised_batchnorm()

    def _warn_unsynchronised_batchnorm(self) -> None:
        """BatchNorm on N ranks without sync_batchnorm normalises each rank's share of the
        batch: other statistics than one process's, and ranks whose running statistics
        differ. Said once, on rank 0, with the option that makes it exact."""
        global _warned_batchnorm
        if (self.world.world_size == 1 or self.world.rank != 0 or _warned_batchnorm
                or self.config.strategy_options.get("sync_batchnorm")):
            return
        with_bn = [p.name for p in self.problems.values()
                   if any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                          for m in p.wrapped.module.modules())]
        if with_bn:
            _warned_batchnorm = True
            warnings.warn(
                f"problem(s) {', '.join(with_bn)} have BatchNorm layers and run on "
                f"{self.world.world_size} ranks: each rank normalises its own share of the "
                "batch, so the result differs from one process and the ranks' running "
                "statistics differ. Pass EngineConfig(..., strategy_options={"
                "'sync_batchnorm': True}) for statistics over the global batch", stacklevel=3)

    def _set_up(self, p: Any, replica: bool) -> None:
        """Betty's order, problem by problem: its data loaders, module, optimizer and
        scheduler from the configure_* hooks, then the setup, then its data iterators: a
        seeded program draws the same initial weights and batches as under Betty."""
        p.initialize()
        super()._set_up(p, replica)
        copy = p._replica
        if copy is not None and self.betty_config.strategy != "default" \
                and not hasattr(copy, "module"):
            # Betty's distributed idiom reads problem.module.module (DDP's inner module);
            # in validation problem.module is this copy, so .module is the copy again. Set
            # past nn.Module's registry: not a submodule (no cycle in modules() or state_dict)
            copy.__dict__["module"] = copy

    # ----- the graph, with Betty's method names --------------------------------------------------
    def _link(self, problems: list[Problem]) -> None:
        self.problems_list = problems
        self.leaves_list: list[Problem] = []
        self.parse_dependency()

    def check_leaf(self, problem: Problem) -> bool:
        """A leaf is no problem's upper (it steps every iteration)."""
        return not any(problem in uppers for uppers in self.dependencies.get("l2u", {}).values())

    def find_paths(self, src: Problem, dst: Problem) -> list[list[Problem]]:
        """Every hypergradient path [dst, ..., src, dst] along l2u routes from src up to
        dst (raises if there is none)."""
        results: list[list[Problem]] = []
        self.dfs(src, dst, [src], results)
        if not results:
            raise ValueError(f"No path from {src.name} to {dst.name}: u2l links them but no "
                             "l2u route leads from the lower problem up to the upper one")
        return [[*reversed(route), dst] for route in results]

    def dfs(self, src: Problem, dst: Problem, path: list[Problem],
            results: list[list[Problem]]) -> None:
        if src is dst and len(path) > 1:
            results.append(list(path))
            return
        for nxt in self.dependencies.get("l2u", {}).get(src, []):
            self.dfs(nxt, dst, [*path, nxt], results)

    def parse_dependency(self) -> None:
        """Paths from u2l, parents and children from l2u, and the leaves."""
        for upper, lowers in self.dependencies.get("u2l", {}).items():
            for lower in lowers:
                upper.add_paths(self.find_paths(lower, upper))
        for lower, uppers in self.dependencies.get("l2u", {}).items():
            for upper in uppers:
                lower.add_parent(upper)
                upper.add_child(lower)
        for p in self.problems_list:
            p.leaf = self.check_leaf(p)
            if p.leaf:
                self.leaves_list.append(p)

    def set_dependency(self, dependencies: Mapping[str, Any]) -> None:
        """Betty's: replace the dependency graph between iterations. Every problem's uppers,
        lowers and paths, and the leaves, are parsed afresh (what each has marked ready is
        kept, as Betty keeps it)."""
        self.dependencies = dependencies
        for p in self.problems_list:
            p.leaf = False
            p.clear_dependencies()
        self._build_graph(dependencies)  # the schedule and paths the steps follow
        self._link(self.problems_list)  # Betty's own view of them
        self._check_methods(self.problems_list)

    def _check_methods(self, problems: list[Problem]) -> None:
        for p in problems:
            for name, what in _NOT_CALLED.items():
                if getattr(type(p), name, None) is not None:
                    raise NotImplementedError(
                        f"{type(p).__name__}.{name} overrides Betty's Problem.{name}, which "
                        f"this drop-in never calls: {what} run through metadist's engine "
                        "under every strategy, so the override would be skipped silently. "
                        "Put the change in an override of optimizer_step or "
                        "one_step_descent (both called where Betty calls them), or in "
                        "param_callback")
        for upper in problems:
            for path in upper.paths:
                for curr in path[1:-1]:
                    if not upper.config.first_order and isinstance(curr, IterativeProblem):
                        raise ValueError(
                            f"{upper.name!r} has first_order=False through IterativeProblem "
                            f"{curr.name!r}: Betty 0.2.1 fails at that problem's first step. "
                            "For hypergradients through unrolled steps use metadist.meta with "
                            "ProblemConfig(method='unrolled')")
                    if curr.config.type in ("neumann", "cg") and curr.paths:
                        raise ValueError(f"{curr.config.type} method is not supported for "
                                         f"higher order MLO ({curr.name!r} has its own "
                                         "upper-to-lower paths); use darts or sama for it")

    # ----- Betty's API --------------------------------------------------------------------------
    def is_rank_zero(self) -> bool:
        return self.world.rank == 0

    def is_implemented(self, fn_name: str) -> bool:
        return callable(getattr(self, fn_name, None))

    def do_validation(self) -> bool:
        return self.is_implemented("validation") and self.is_rank_zero()

    def _validation_metrics(self, returned: Mapping[str, Any]) -> dict[str, Any]:
        """Betty's validation results as they are (numbers, lists, strings; a 0-dim tensor
        as its number), for its log line and logger."""
        return {k: v.item() if isinstance(v, Tensor) and v.dim() == 0 else v
                for k, v in returned.items()}

    def validate(self) -> None:
        super().validate()
        if self.is_rank_zero():
            get_logger().info(f"[Validation] [Global Step {self.global_step}] "
                              f"{_log_line(self.last_validation)}")

    def cleanup(self) -> None:
        """Nothing to tear down: the process group belongs to the launcher."""

    def train(self) -> None:
        for p in self.problems.values():
            p.train()

    def eval(self) -> None:
        for p in self.problems.values():
            p.eval()

    def run(self) -> None:
        self.train()
        super().run()
        self.cleanup()

    def train_step(self) -> None:
        for leaf in self.leaves:
            leaf.step(global_step=self.global_step)

    # ----- one problem's step ------------------------------------------------------------
    def _betty_step(self, p: Any, global_step: int | None) -> None:
        if not p.check_ready():
            return
        if p._inner_loop_start:
            if p.is_implemented("on_inner_loop_start"):
                p.on_inner_loop_start()
            p._inner_loop_start = False
            if p._roll_back:
                p.cache_states()
        if p._training:
            p._count += 1
        stats = p.one_step_descent()
        if p.scheduler is not None and not p._roll_back:
            p.scheduler.step()
        log_step = p.config.log_step
        if log_step > 0 and p._count % log_step == 0 and p.is_rank_zero():
            p.log(stats, global_step)
        window = p.config.unroll_steps * p.config.gradient_accumulation
        done = p._training and p._count % window == 0 and p._count > p.config.warmup_steps
        if done:
            for parent in p.parents:
                parent.ready[parent.children.index(p)] = True
                self._betty_step(parent, global_step)
            p._inner_loop_start = True
        p.ready = [False] * len(p.children)
        if done:
            self._after_roll_back(p)

    def _after_roll_back(self, p: Any) -> None:
        if not (p.check_ready() and p._training):
            return
        if p._roll_back:
            p.recover_states()
            p.one_step_descent(batch=p.cur_batch)
            if p.scheduler is not None:
                p.scheduler.step()
            for parent in p.parents:
                parent.ready[parent.children.index(p)] = True
                self._after_roll_back(parent)
        p.ready = [False] * len(p.children)

    def _descent(self, p: Any, batch: Any = None) -> dict[str, Any]:
        """Betty's one_step_descent: loss, gradient, callbacks, and the optimizer at the
        accumulation boundary."""
        if batch is None:
            p.cur_batch = batch = p.get_batch()
        p.batch = batch
        gas = p.config.gradient_accumulation
        boundary = p.gradient_accumulation_boundary()
        if p.paths:
            grads, out = upper_gradient(self, p)
            if gas > 1:
                grads = (grads / gas if isinstance(grads, FastWeights)
                         else {n: g / gas for n, g in grads.items()})
            p.accumulate_grads(grads, owned=True)
            loss = out["loss"] if isinstance(out, dict) else out
            stats: dict[str, Any] = {"loss": float(loss.detach())}
            if isinstance(out, dict):
                stats.update({k: v for k, v in out.items() if k != "loss"})
        else:
            with self._bound({p.name: None}):
                loss, stats = p.get_loss(batch)
            if not loss.requires_grad:
                raise ValueError(f"problem {p.name!r}'s loss does not depend on its module's "
                                 "parameters; call self(...) or self.module(...) in "
                                 "training_step, outside torch.no_grad()")
            self._plain_backward(p, loss * gas if gas > 1 else loss, gas, boundary)
        if p.is_implemented("grad_callback"):
            p.grad_callback()
        if boundary:
            self._optimizer(p)
            if p.is_implemented("param_callback"):
                p.param_callback()
            p.zero_grad()
        return stats

    def _optimizer(self, p: Any) -> None:
        p.optimizer_step()  # Betty's, or a subclass's override of it
        if p.config.type == "sama" and not p.is_implemented("custom_optimizer_step"):
            record_last_grads(p)
