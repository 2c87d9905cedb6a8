"""Betty's ``betty.problems``: ``Problem``, ``ImplicitProblem``, ``IterativeProblem``.

A Betty problem is metadist's :class:`~metadist.meta.Problem` with Betty's constructor
(``name, config, module, optimizer, scheduler, train_data_loader, extra_config``), its
``configure_*`` and ``get_batch`` hooks, its attributes (``leaf``, ``parents``,
``children``, ``paths``, ``cur_batch``, ``count``, ``device``, ``env``, ...) and its
callbacks, which :class:`~metadist.compat.betty.engine.Engine` calls where Betty does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from metadist.checkpoint.capture import module_placement
from metadist.compat.betty.configs import Config
from metadist.compat.betty.rebuild import betty_optimizer, betty_scheduler
from metadist.errors import CollectiveAloneError
from metadist.meta.config import ProblemConfig
from metadist.meta.problem import Problem as NativeProblem
from metadist.strategies.base import Strategy
from metadist.strategies.placement import held
from metadist.strategies.tensors.elsewhere import held_grad

if TYPE_CHECKING:
    from metadist.meta.engine import Engine as NativeEngine


class Problem(NativeProblem):
    """Betty's base problem (subclass :class:`ImplicitProblem`, as in Betty)."""

    def __init__(self, name: str, config: Config | None = None, module: nn.Module | None = None,
                 optimizer: Optimizer | None = None, scheduler: Any = None,
                 train_data_loader: Any = None, extra_config: Any = None) -> None:
        # metadist's Problem is built in initialize(), once the configure_* hooks ran.
        self._betty_name = self.name = name
        self._betty_config = config if config is not None else Config()
        self.cfg = extra_config
        self._user_module = module
        self._optimizer_given, self._scheduler_given = optimizer, scheduler
        self._loader_given = train_data_loader
        self._loaders: list[Any] = []
        self._iterators: list[Any] = []
        self.epoch_counter: list[int] = []
        self.device: torch.device | str | None = None
        self.env: Any = None
        self.logger: Any = None
        self._parents: list[Problem] = []
        self._children: list[Problem] = []
        self._paths: list[list[Problem]] = []
        self._leaf = False
        self.cur_batch: Any = None
        self._count = 0
        self._global_step: int | None = 0  # the engine's iteration at its last step() call
        self.ready: list[bool] = []
        self._inner_loop_start = True
        self._roll_back = False
        self._cache: tuple[Any, Any] | None = None
        self._training = True

    # ----- construction (called by the engine) -------------------------------------------------
    def initialize(self) -> None:
        """Resolve the configure_* hooks and build metadist's problem from them."""
        loader = self._loader_given
        if loader is None and self.is_implemented("configure_train_data_loader"):
            loader = self.configure_train_data_loader()
        if loader is None and type(self).get_batch is Problem.get_batch:
            raise ValueError(f"problem {self._betty_name!r} has no data: pass "
                             "train_data_loader, implement configure_train_data_loader(), or "
                             "override get_batch()")
        self._loaders = [] if loader is None else list(loader if isinstance(loader, tuple)
                                                         else (loader,))
        module = self._user_module
        if module is None and self.is_implemented("configure_module"):
            module = self.configure_module()
        if module is None:
            raise ValueError(f"problem {self._betty_name!r} has no module: pass module= or "
                             "implement configure_module()")
        self._user_module = module  # configure_optimizer reads self.module
        optimizer = self._optimizer_given
        if optimizer is None and self.is_implemented("configure_optimizer"):
            optimizer = self.configure_optimizer()
        if optimizer is None:
            raise ValueError(f"problem {self._betty_name!r} has no optimizer: pass optimizer= "
                             "or implement configure_optimizer()")
        self.optimizer = optimizer  # configure_scheduler reads self.optimizer
        scheduler = self._scheduler_given
        if scheduler is None and self.is_implemented("configure_scheduler"):
            scheduler = self.configure_scheduler()
        rebuilt = betty_optimizer(self, optimizer, module)
        if rebuilt is not optimizer and scheduler is not None:
            scheduler = betty_scheduler(self, scheduler, rebuilt)
        optimizer = rebuilt
        NativeProblem.__init__(self, self._betty_name, module, optimizer, scheduler, None,
                               cast(ProblemConfig, self._betty_config))
        self.ready = [False] * len(self._children)

    def attach(self, engine: NativeEngine, strategy: Strategy, seed: int) -> None:
        super().attach(engine, strategy, seed)
        self.device = strategy.device
        # seed=None: each epoch's order from the global random state, drawn when Betty's
        # (torch's) loader draws it; the iterators are made now, as Betty makes them
        self._loaders = [strategy.setup_dataloader(x, seed=None) if isinstance(x, DataLoader)
                         else x for x in self._loaders]
        self._iterators = [iter(x) for x in self._loaders]
        self.epoch_counter = [0] * len(self._loaders)
        if strategy.scaler is not None:  # precision="fp16": Betty's GradScaler settings
            strategy.scaler.scale_value = float(self.config.initial_dynamic_scale)
            strategy.scaler.growth_factor = float(self.config.scale_factor)

    @property
    def scaler(self) -> Any:
        """The loss scaler of precision="fp16" (None otherwise), synchronised across ranks."""
        return None if self.strategy is None else self.strategy.scaler

    # ----- Betty's attributes -----------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        if "_module" not in self.__dict__:  # before initialize(): what the user gave
            return cast(nn.Module, self._user_module)
        return NativeProblem.module.fget(self)  # type: ignore[attr-defined,no-any-return]

    @module.setter
    def module(self, value: nn.Module) -> None:
        if "_module" in self.__dict__:
            raise AttributeError(f"problem {self._betty_name!r} is set up; its module cannot "
                                 "be replaced (build a new problem and engine)")
        self._user_module = value

    @property  # type: ignore[override]
    def config(self) -> Config:
        """Betty's Config of this problem (metadist's engine reads it through its
        ``method``, ``unroll_steps``, ``gradient_accumulation`` and ``precision``)."""
        return self._betty_config

    @config.setter
    def config(self, value: Any) -> None:
        if value is not self._betty_config:
            raise AttributeError("a Betty problem's config is set by its constructor")

    @property
    def leaf(self) -> bool:
        return self._leaf

    @leaf.setter
    def leaf(self, value: bool) -> None:
        self._leaf = value

    @property
    def parents(self) -> list[Problem]:
        return self._parents

    @property
    def children(self) -> list[Problem]:
        return self._children

    @property
    def paths(self) -> list[list[Problem]]:
        return self._paths

    @property
    def count(self) -> int:
        return self._count

    def add_child(self, problem: Problem) -> None:
        assert problem not in self._children
        self._children.append(problem)

    def add_parent(self, problem: Problem) -> None:
        assert problem not in self._parents
        self._parents.append(problem)

    def add_paths(self, paths: Iterable[list[Problem]]) -> None:
        self._paths.extend(paths)

    def clear_dependencies(self) -> None:
        """Forget this problem's uppers, lowers and paths (Betty's)."""
        self._children, self._parents, self._paths = [], [], []

    # ----- Betty's setters -----------------------------------------------------------------
    def set_module(self, module: nn.Module) -> None:
        """Betty's: the problem runs ``module`` from now on, set up under the engine's
        strategy; its optimizer goes on stepping what it was built over until
        :meth:`set_optimizer` (as Betty's)."""
        if "_module" not in self.__dict__:
            self._user_module = module
            return
        self.replace(module=module)

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Betty's: ``type(optimizer)`` with its defaults over the problem's parameters as
        they are now (its ``param_groups()`` where defined), set up under the strategy."""
        if "_module" not in self.__dict__:
            self._optimizer_given = optimizer
            return
        self.replace(optimizer=betty_optimizer(self, optimizer, self.module))

    def set_scheduler(self, scheduler: Any) -> None:
        """Betty's: ``scheduler`` steps after this problem's optimizer from now on (rebuilt
        over that optimizer where it was built over another, as Betty does)."""
        if "_module" not in self.__dict__:
            self._scheduler_given = scheduler
            return
        if getattr(scheduler, "optimizer", self.optimizer) is not self.optimizer:
            scheduler = betty_scheduler(self, scheduler, self.optimizer)
        self.scheduler = scheduler

    def set_train_data_loader(self, loader: Any, idx: int = 0) -> None:
        """Betty's: loader ``idx`` is ``loader`` (each rank reading its share of every
        batch); the epoch under way finishes on the old one, as Betty's iterator does."""
        if "_module" not in self.__dict__:  # before the engine: what initialize() sets up
            given = self._loader_given
            loaders = list(given) if isinstance(given, tuple) else [given]
            loaders[idx] = loader
            self._loader_given = tuple(loaders) if len(loaders) > 1 else loaders[0]
            return
        assert self.strategy is not None
        self._loaders[idx] = (self.strategy.setup_dataloader(loader, seed=None)
                              if isinstance(loader, DataLoader) else loader)

    def add_logger(self, logger: Any) -> None:
        if self.logger is None:
            self.logger = logger

    def add_env(self, env: Any) -> None:
        if self.env is None:
            self.env = env

    def is_implemented(self, fn_name: str) -> bool:
        return callable(getattr(type(self), fn_name, None))

    def is_rank_zero(self) -> bool:
        return self.strategy is None or self.strategy.world.rank == 0

    def check_ready(self) -> bool:
        return all(self.ready)

    def gradient_accumulation_boundary(self) -> bool:
        return self._count % self.config.gradient_accumulation == 0

    def parameters(self) -> list[Tensor]:
        """The parameters this problem's calls run on right now: the engine's bound tensors
        while a hypergradient is computed (so a loss term on them, e.g. iMAML's proximal
        term, is differentiated), otherwise its own."""
        return list(self.parameters_dict().values())

    def step(self, global_step: int | None = None) -> None:
        """One Betty step of this problem (its uppers follow when their windows complete);
        what a custom ``Engine.train_step`` calls on each leaf."""
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"problem {self._betty_name!r} is not part of an engine yet")
        self._global_step = global_step
        engine._betty_step(self, global_step)

    # ----- Betty's steps a subclass may override (the engine calls these) ---------------------
    def one_step_descent(self, batch: Any = None) -> dict[str, Any]:
        """Betty's one gradient step: the next batch (or ``batch``), the loss, its gradient
        and, at an accumulation boundary, :meth:`optimizer_step`; returns the logged stats."""
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"problem {self._betty_name!r} is not part of an engine yet")
        stats: dict[str, Any] = engine._descent(self, batch)
        return stats

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Betty's update at an accumulation boundary: clipping (``gradient_clipping`` > 0),
        then ``custom_optimizer_step`` where defined, else the optimizer's step."""
        if self.config.gradient_clipping > 0.0:
            self.clip_grad()
        if self.is_implemented("custom_optimizer_step"):
            self.custom_optimizer_step(*args, **kwargs)
            return
        self.optimizer.step()

    def trainable_parameters(self) -> list[Tensor]:
        """The tensors this problem's optimizer steps (this rank's shards under zero3)."""
        return self.trainable()

    def meta_trainable_parameters(self) -> list[Tensor]:
        return self.trainable_parameters()

    def train(self) -> None:
        self._training = True
        self.module.train()

    def eval(self) -> None:
        self._training = False
        self.module.eval()

    # ----- data -------------------------------------------------------------------------------
    def get_batch(self) -> Any:
        """The next batch of every loader (one loader: its batch), on this problem's device."""
        batches = tuple(self.get_batch_single_loader(i) for i in range(len(self._loaders)))
        return batches[0] if len(batches) == 1 else batches

    def get_batch_single_loader(self, idx: int) -> Any:
        try:
            batch = next(self._iterators[idx])
        except StopIteration:
            if idx == 0 and self.is_implemented("epoch_callback"):
                self.epoch_callback()
            self.epoch_counter[idx] += 1
            self._iterators[idx] = iter(self._loaders[idx])  # the next epoch's order
            batch = next(self._iterators[idx])
        assert self.strategy is not None
        self.batch_share = self.strategy.grad_scale() * self.strategy.world.world_size
        if isinstance(batch, dict):
            return {k: v.to(self.device) if isinstance(v, Tensor) else v
                    for k, v in batch.items()}
        return tuple(v.to(self.device) if isinstance(v, Tensor) else v for v in batch)

    def training_step_exec(self, batch: Any) -> Any:
        return self.training_step(batch)  # the strategy's forward applies the precision

    def get_loss(self, batch: Any) -> tuple[Tensor, dict[str, Any]]:
        """(loss / gradient_accumulation, {"loss": float, other returned metrics})."""
        out = self.training_step_exec(batch)
        loss = out["loss"] if isinstance(out, dict) else out
        stats: dict[str, Any] = {"loss": loss.item()}
        if isinstance(out, dict):
            stats.update({k: v for k, v in out.items() if k != "loss"})
        gas = self.config.gradient_accumulation
        return (loss / gas if gas > 1 else loss), stats  # x / 1 is x: skip the kernel

    # ----- gradients and state ------------------------------------------------------------------
    def set_grads(self, params: Iterable[Tensor], grads: Iterable[Tensor | None]) -> None:
        for p, g in zip(params, grads, strict=False):
            if g is not None:
                self.gradient_arrives(p)
                mine = held_grad(p)  # zero2: not another owner's placeholder
                p.grad = g if mine is None else mine + g

    def zero_grad(self) -> None:
        for p in self.trainable_parameters():
            p.grad = None

    def clip_grad(self) -> None:
        assert self.strategy is not None
        self.strategy.clip_grad_norm_(self.wrapped, self.config.gradient_clipping)

    def synchronize_params(self, params: Any = None, all_reduce: bool = False) -> None:
        """A no-op: every strategy keeps the replicas equal by construction."""

    def get_opt_param_group_for_param(self, param: Tensor) -> dict[str, Any] | None:
        for group in self.optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return group
        return None

    def get_opt_state_for_param(self, param: Tensor) -> Any:
        return self.optimizer.state[param]

    def state_dict(self) -> dict[str, Any]:
        """Module and optimizer (plain single-process format; collective), scheduler, scaler.
        In validation (rank 0 alone) the module's is its local copy's, the current weights;
        an optimizer whose state is spread over the ranks stops, saying so."""
        assert self.strategy is not None
        engine = self._engine
        if engine is not None and engine.validating and self._replica is not None:
            module = self._replica.state_dict()
            try:
                optimizer = self.strategy.optimizer_state_dict(self.optimizer)
            except CollectiveAloneError as exc:
                raise CollectiveAloneError(
                    f"{type(self).__name__}.state_dict() in validation(): the optimizer's "
                    f"state under strategy {_strategy_name(engine)!r} is spread over the "
                    f"ranks, and validation() runs on rank 0 only. In validation, "
                    f"self.{self.name}.module.state_dict() is the whole model's; save the "
                    f"problem's whole state outside validation (e.g. after engine.run()).",
                    op=exc.op, region=exc.region) from None
            out = {"module": module, "optimizer": optimizer}
        else:
            out = {"module": self.wrapped.state_dict(),
                   "optimizer": self.strategy.optimizer_state_dict(self.optimizer)}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.strategy.scaler is not None:
            out["scaler"] = self.strategy.scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        assert self.strategy is not None
        self.wrapped.load_state_dict(state_dict["module"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scheduler is not None and "scheduler" in state_dict:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        if self.strategy.scaler is not None and "scaler" in state_dict:
            self.strategy.scaler.load_state_dict(state_dict["scaler"])

    def cache_states(self) -> None:
        """roll_back: keep the module's and optimizer's state at the unroll window's start,
        as this rank holds it (zero3/hsdp: its shards; no collective): copies of the
        tensors the strategy's layout description names, and of the optimizer's state."""
        where = module_placement(self.wrapped)
        tensors = {p.name: [held(q).clone() for q in p.parts] for p in where.tensors}
        values = {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                  for k, v in where.values.items()}
        self._cache = ((tensors, values), _cloned(self.optimizer.state_dict()))

    def recover_states(self) -> None:
        assert self._cache is not None
        (tensors, values), optimizer_state = self._cache
        module_placement(self.wrapped).load(tensors, values)
        self.optimizer.load_state_dict(optimizer_state)
        self._cache = None

    def log(self, stats: dict[str, Any], global_step: int | None) -> None:
        text = " || ".join(f"{k}: {float(v) if isinstance(v, Tensor) else v}"
                           for k, v in stats.items())
        where = "" if global_step is None else f"[Global Step {global_step}] "
        self.logger.info(f'[Problem "{self._betty_name}"] {where}[Local Step {self._count}] '
                         f"{text}")
        local = global_step is None or self.config.log_local_step
        self.logger.log(stats, tag=self._betty_name, step=self._count if local else global_step)


class ImplicitProblem(Problem):
    """Betty's problem whose module and optimizer are plain torch objects."""


def _strategy_name(engine: Any) -> str:
    """The strategy as the program named it: Betty's name under the drop-in's engine."""
    betty = getattr(engine, "betty_config", None)
    return str(betty.strategy if betty is not None else engine.config.strategy)


def _cloned(state: Any) -> Any:
    """``state`` (an optimizer's state dict) with every tensor cloned: element by element, so
    also the slices a sharded optimizer holds (a deep copy of those is refused)."""
    if isinstance(state, Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_cloned(v) for v in state)
    return copy.deepcopy(state)


class HigherIterativeProblem(Problem):
    """Betty's problem built on the ``higher`` library; Betty 0.2.1 itself fails on it with
    torch 2.13, so here its construction says what to use instead."""

    def __init__(self, name: str, config: Config | None = None, *args: Any,
                 **kwargs: Any) -> None:
        raise NotImplementedError(
            f"HigherIterativeProblem {name!r}: Betty 0.2.1's higher-based problem does not run "
            "with torch 2.13 (in Betty itself either). Use ImplicitProblem (or "
            "IterativeProblem) for the problem; for hypergradients through its unrolled "
            "steps use metadist.meta with ProblemConfig(method='unrolled')")


class IterativeProblem(Problem):
    """Betty's problem meant for hypergradients through its unrolled updates (an upper
    problem with ``first_order=False``). Betty 0.2.1 fails at this problem's first optimizer
    step, so no Betty program computes that; here the engine refuses it with what to use
    instead, and otherwise it behaves as :class:`ImplicitProblem`."""
