"""One level of a multilevel optimisation problem.

Subclass :class:`Problem` and implement ``training_step(batch) -> loss`` (or a dict with a
``"loss"`` key and other metrics). Inside it, ``self(x)`` (or ``self.module(x)``) runs this
problem's module and ``self.<name>(x)`` runs the problem called ``name``, e.g. a lower level
``self.classifier(x)`` or an upper level ``self.weighting(losses)``. The
:class:`~metadist.meta.Engine` decides which parameters each of those calls sees: a
problem's own parameters when it steps, fast weights while a hypergradient is computed, and
everyone else's parameters in a way no gradient can reach them, so gradients only ever reach
what is being trained.

The engine sets the problem up under its strategy: ``module`` is the wrapped module,
``optimizer`` the user's optimizer object (LR schedulers stay bound to it), ``strategy`` the
problem's strategy, and ``batch`` the batch of the current step.
"""

from __future__ import annotations

import copy
import keyword
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

from metadist.meta.config import ProblemConfig
from metadist.meta.modules import trainable_slots
from metadist.strategies.base import Strategy
from metadist.strategies.bind import bind_parameters
from metadist.strategies.fast_weights import FastWeights
from metadist.strategies.module import DistributedModule
from metadist.strategies.placement import Part, paste

if TYPE_CHECKING:
    from metadist.meta.engine import Engine


def loss_of(out: Any, who: str) -> Tensor:
    """The scalar loss in what ``training_step`` returned (a tensor or ``{"loss": ...}``)."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"{who}.training_step must return a scalar tensor or a dict with a "
                         f"scalar 'loss'; got {type(out).__name__}"
                         + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""))
    return loss.reshape(())


# Attributes every problem has: a problem with one of these names could not be reached by name.
_RESERVED = frozenset({"name", "config", "optimizer", "scheduler", "train_data_loader",
                       "strategy", "batch", "batch_share", "micro_steps", "steps", "last_loss",
                       "replicated"})


class Problem(ABC):
    """A module, its optimizer (and optional LR scheduler), its training data and the loss it
    minimises. ``name`` must be a Python identifier: other problems reach this one as
    ``self.<name>``. A ``DataLoader`` is split across ranks by the strategy (each rank reads
    its slice of every global batch); any other iterable is read as it is."""

    def __init__(self, name: str, module: nn.Module, optimizer: Optimizer,
                 scheduler: LRScheduler | None = None,
                 train_data_loader: DataLoader[Any] | Iterable[Any] | None = None,
                 config: ProblemConfig | None = None) -> None:
        if (not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_")
                or name in _RESERVED or hasattr(type(self), name)):
            raise ValueError(f"problem name {name!r} cannot be used: it must be a Python "
                             "identifier that is not a keyword, does not start with '_' and is "
                             f"not an attribute of {type(self).__name__} (e.g. 'inner', "
                             "'outer', 'classifier')")
        if not isinstance(module, nn.Module) or isinstance(module, DistributedModule):
            raise TypeError(f"problem {name!r} needs the user's nn.Module (not yet set up by a "
                            f"strategy), got {type(module).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"problem {name!r} needs a torch.optim optimizer over its module's "
                            f"parameters, got {type(optimizer).__name__}")
        self.name = name
        self.config = config or ProblemConfig()
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_data_loader = train_data_loader
        self.strategy: Strategy | None = None
        self.batch: Any = None
        self.batch_share = 1.0
        self._module: nn.Module = module
        self._replica: nn.Module | None = None  # rank 0's local copy for validation
        self.replicated = True
        self._names: frozenset[str] = frozenset()  # trainable, for run_with's check
        self._trainable: list[Tensor] = []
        self._bound_params: Mapping[str, Tensor] | FastWeights | None = None  # in bound()
        self._engine: Engine | None = None
        self._iterator: Any = None
        # step counters: micro-batches, optimizer steps, steps in the current unroll window
        self.micro_steps = 0
        self.steps = 0
        self._window = self.config.unroll_steps  # "complete": the first step opens a window
        self._ready: set[str] = set()
        # "unrolled" replays: parameters at the window's start and each step's (batch, share)s
        self._theta0: dict[str, Tensor] | FastWeights = {}
        self._record: list[list[tuple[Any, float]]] = []
        self.last_loss: Tensor | None = None

    # ----- what users write ------------------------------------------------------------
    @abstractmethod
    def training_step(self, batch: Any) -> Tensor | Mapping[str, Any]:
        """This problem's loss on ``batch`` (a mean over this rank's samples)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``self(x)``: run this problem's module (override to change what a call means)."""
        return self.module(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The strategy's wrapped module; during :meth:`Engine.validation` on rank 0, a local
        replica holding the same weights (so validation code issues no collective)."""
        engine = self._engine
        if engine is not None and engine.validating and self._replica is not None:
            return self._replica
        return self._module

    def parameters_dict(self) -> dict[str, Tensor]:
        """The parameters this problem's calls run on right now, by name: fast weights while
        a hypergradient is computed, its own trainable parameters (differentiable) when it
        steps, otherwise its parameters as no gradient reaches them. Use it for terms on the
        weights (e.g. a weight decay a hyperparameter controls)."""
        if self._engine is not None and self._engine.validating and self._replica is not None:
            return {n: p for n, p in self._replica.named_parameters() if p.requires_grad}
        if isinstance(self._bound_params, FastWeights):
            return self._bound_params.full()  # gathered, differentiable into the pieces
        if self._bound_params is not None:
            return dict(self._bound_params)
        return self.wrapped.full_parameters()

    def functional_forward(self, params: Mapping[str, Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run this problem's module on ``params`` (names as in :meth:`parameters_dict`), e.g.
        weights adapted in an inner loop; works under every strategy and in validation."""
        if self._engine is not None and self._engine.validating and self._replica is not None:
            with bind_parameters(self._replica, params):
                return self._replica(*args, **kwargs)
        return self.run_with(params, args, kwargs)

    def __getattr__(self, name: str) -> Problem:
        # Only reached for missing attributes: other problems by name (``self.outer``).
        engine: Engine | None = self.__dict__.get("_engine")
        if name.startswith("_") or engine is None or name not in engine.problems:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}"
                                 + ("" if name.startswith("_") or engine is None else
                                    f"; problems of this engine: {', '.join(engine.problems)}"))
        return engine.problems[name]

    # ----- used by the engine ------------------------------------------------------------
    @property
    def wrapped(self) -> DistributedModule:
        """The strategy's wrapped module (raises before the engine set this problem up)."""
        module = self._module
        if not isinstance(module, DistributedModule):
            raise RuntimeError(f"problem {self.name!r} is not set up yet; pass it to "
                               "metadist.meta.Engine(problems, ...) first")
        return module

    def attach(self, engine: Engine, strategy: Strategy, seed: int) -> None:
        """Set up module, optimizer and loader under ``strategy`` (the optimizer object stays
        the user's, so schedulers built on it keep working)."""
        if self._engine is not None:
            raise ValueError(f"problem {self.name!r} already belongs to an engine; build a new "
                             "Problem (with a fresh module and optimizer) for another engine")
        self._engine, self.strategy = engine, strategy
        module, optimizer = strategy.setup(self._module, self.optimizer)
        if optimizer is not self.optimizer:  # strategies adapt the user's object in place
            raise RuntimeError(f"strategy {strategy.name!r} replaced problem {self.name!r}'s "
                               "optimizer object; its LR scheduler would be left behind")
        self._module = module
        self._read_module()
        if isinstance(self.train_data_loader, DataLoader):
            # Other iterables are read as they are: sharding them is up to the user.
            self.train_data_loader = strategy.setup_dataloader(self.train_data_loader,
                                                               seed=seed)

    def _read_module(self) -> None:
        """What the engine reads of the set-up module, fixed for the life of its setup."""
        module = self._module
        assert isinstance(module, DistributedModule)
        # Replicated strategies (single, ddp, zero1, zero2) keep whole leaf parameters in the
        # module: those run on explicit tensors bound into the user's module (run_with);
        # sharded ones use functional_forward, which places full parameters over the shards.
        self._placement = module.placements()  # where its tensors live
        self.replicated = self._placement.in_module and all(
            t.is_leaf for t in module.full_parameters().values())
        self._names = frozenset(n for n, _ in trainable_slots(module.module))
        # the same leaf tensors for the life of the setup (inside bound() the module holds
        # others)
        self._trainable = [t for t in module.graph_leaves() if t.requires_grad]

    def replace(self, module: nn.Module | None = None,
                optimizer: Optimizer | None = None) -> None:
        """Set a new ``module`` and/or ``optimizer`` up under this problem's strategy in the
        middle of training. A new module starts from rank 0's weights, laid out as the
        strategy lays out any model; the optimizer goes on stepping what it was built over
        until it is replaced too. A new optimizer is built over this problem's parameters as
        they are now (``problem.module.parameters()``, after setup)."""
        strategy = self.strategy
        if strategy is None:
            raise RuntimeError(f"problem {self.name!r} is not set up by an engine yet: give "
                               "the module and optimizer to its constructor")
        if module is not None:
            if self._replica is not None:  # rank 0's copy for validation follows
                self._replica = copy.deepcopy(module).to(strategy.device)
            self._module = strategy.setup_module(module)
            self._read_module()
        if optimizer is not None:
            self.optimizer = strategy.setup_optimizer(self.wrapped, optimizer)

    def next_batch(self) -> Any:
        """The next batch of this rank's share (a new epoch starts when one runs out), moved
        to the strategy's device; ``None`` without a loader."""
        loader = self.train_data_loader
        if loader is None:
            return None
        if self._iterator is None:
            self._iterator = iter(loader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = iter(loader)  # the distributed loader moves to the next epoch
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ValueError(f"problem {self.name!r}'s data loader yields no batch; give "
                                 "it at least one global batch of data") from None
        assert self.strategy is not None
        # This rank's share of the global batch times N (1.0 when all ranks hold as many
        # samples), read now: the engine may re-weight the strategy before backward.
        self.batch_share = self.strategy.grad_scale() * self.strategy.world.world_size
        device = self.strategy.device
        return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, batch)

    def inner_params(self, *, clone: bool = False) -> dict[str, Tensor] | FastWeights:
        """The parameters a hypergradient takes as its inner parameters: :meth:`params`,
        or under zero3/hsdp this rank's shard pieces as fast weights (detached), so that a
        hypergradient through unrolled steps holds shards, not whole copies
        (strategies/zero3/sharded_fast.py; the results are the same)."""
        if self.replicated:
            return self.params(clone=clone)
        fast = self.wrapped.fast_weights()
        return fast.map(lambda t: t.detach().clone() if clone else t.detach())

    def params(self, *, clone: bool = False) -> dict[str, Tensor]:
        """This problem's current full parameters by name, detached (cloned with
        ``clone=True``: the optimizer step updates replicated parameters in place)."""
        with torch.no_grad():
            full = self.wrapped.full_parameters()  # zero1/2: waits for in-flight refreshes
            return {n: (p.detach().clone() if clone else p.detach()) for n, p in full.items()}

    def run_with(self, params: Mapping[str, Tensor], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        """The wrapped module's forward on ``params`` (every trainable parameter by name)."""
        module = self.wrapped
        if not self.replicated:
            return module.functional_forward(params, *args, **kwargs)
        unknown = sorted(set(params) - self._names)
        if unknown:
            raise ValueError(f"problem {self.name!r} has no trainable parameter(s) {unknown}; "
                             "use the names of self.parameters_dict()")
        module.wait_params()  # zero1/zero2: refreshes in flight land in these parameters
        module.pre_forward()
        with bind_parameters(module.module, params):
            return module.run(module.module, args, kwargs)

    def trainable(self) -> list[Tensor]:
        """The leaf tensors this problem's gradients accumulate into (shards under zero3),
        their values current (zero1/zero2 with ``overlap_param_gather=True`` refresh them
        after a step asynchronously: whoever reads them through this list waits first)."""
        self.wrapped.wait_params()
        return self._trainable

    @contextmanager
    def bound(self, params: Mapping[str, Tensor] | FastWeights) -> Iterator[None]:
        """Within: this problem's module holds ``params`` for every path that reaches it
        (:meth:`~metadist.strategies.DistributedModule.bound`; fast weights on shards: every
        forward of its units gathers them), and :meth:`parameters_dict` returns them."""
        outer, self._bound_params = self._bound_params, params
        try:
            with self.wrapped.bound(params):
                yield
        finally:
            self._bound_params = outer

    def accumulate_grads(self, grads: Mapping[str, Tensor] | FastWeights, *,
                         owned: bool = False) -> None:
        """Add ``grads`` (full-parameter gradients, identical on every rank, already averaged
        over ranks; or, under zero3/hsdp, gradients of this problem's shard pieces as fast
        weights) into the ``.grad`` of exactly the tensors this problem's optimizer steps,
        with no collective: the reducer is bypassed so nothing is averaged twice. ``owned``:
        the tensors are the caller's to give away (fresh results), so none is copied."""
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if isinstance(grads, FastWeights):
            self._accumulate_pieces(grads, stepped)
            return
        module = self.wrapped
        if self._placement.in_module:
            # The user's module holds every parameter whole: each gradient lands in the
            # tensor it holds now (also one replaced since setup, e.g. by
            # load_state_dict(assign=True); 0-dim ones too).
            params = module.full_parameters()
            for name, g in grads.items():
                p = params.get(name)
                if p is None:
                    raise KeyError(f"problem {self.name!r} has no trainable parameter {name!r}")
                self._check_leaf(p)
                if id(p) in stepped:  # zero1/zero2: only this rank's own parameters
                    _add_grad(p, g, owned)
            return
        # Each gradient lands in the parts of its parameter this rank's optimizer steps (its
        # slice of a zero3 flat shard; strategies/placement.py), which records that these
        # parameters have a gradient (the others are skipped by the step, as in one process).
        self._placement.gradients_added(grads)
        landing: dict[int, tuple[Tensor, list[tuple[Part, Tensor]]]] = {}
        for name, g in grads.items():
            placement = self._placement.find(name)
            if placement is None:
                raise KeyError(f"problem {self.name!r} has no trainable parameter {name!r}")
            for part in placement.parts:
                self._check_leaf(part.local)
                if id(part.local) in stepped:
                    landing.setdefault(id(part.local), (part.local, []))[1].append((part, g))
        for local, pieces in landing.values():
            part, g = pieces[0]
            if len(pieces) == 1 and part.numel == local.numel() and g.shape == local.shape:
                _add_grad(local, g, owned)  # the whole tensor: no buffer to fill
                continue
            # slices of several parameters (zero3): zeros where none has a gradient
            buf = torch.zeros(local.numel(), dtype=local.dtype, device=local.device)
            for part, g in pieces:
                paste(part.on(buf), g.detach().reshape(-1)[part.start:part.stop])
            _add_grad(local, buf.view(local.shape), owned=True)

    def _accumulate_pieces(self, grads: FastWeights, stepped: set[int]) -> None:
        """Gradients of the shard pieces, each added to the flat shard it is a piece of."""
        shards_of = getattr(grads.layout, "shards_of", None)
        held = {id(q.local) for pl in self._placement.tensors for q in pl.parts}
        if shards_of is None or not grads.layout.sharded:
            raise TypeError(f"problem {self.name!r}: gradients as fast weights land only in "
                            "zero3/hsdp shards; pass full-parameter gradients by name")
        landing = shards_of(grads.pieces)
        if any(id(shard) not in held for shard, _ in landing):
            raise ValueError(f"problem {self.name!r}: these fast weights are not of this "
                             "problem's module; pass the gradients of its own "
                             "fast_weights()")
        for shard, g in landing:
            self._check_leaf(shard)
            self.gradient_arrives(shard)
            if id(shard) in stepped:
                _add_grad(shard, g)

    def gradient_arrives(self, t: Tensor) -> None:
        """A gradient for all of ``t`` (one of :meth:`trainable`) is about to be written by
        other means than a backward or :meth:`accumulate_grads`: every parameter it holds
        has one (zero3 skips those without, strategies/zero3/unreached.py)."""
        self._placement.gradients_added(
            [pl.name for pl in self._placement.tensors if any(q.local is t for q in pl.parts)])

    def _check_leaf(self, t: Tensor) -> None:
        if not t.is_leaf:
            raise TypeError(f"problem {self.name!r}: strategy module "
                            f"{type(self.wrapped).__name__} keeps its parameters outside the "
                            "module; the engine supports single, ddp, zero1, zero2, zero3 and "
                            "hsdp")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={self.config!r})"


def _add_grad(p: Tensor, g: Tensor, owned: bool = False) -> None:
    moved = g.detach().to(p.device, p.dtype)
    if p.grad is None:
        # ``owned``: the caller hands over a fresh tensor nothing else holds (no copy needed)
        p.grad = moved if owned else moved.clone()
    else:
        p.grad.add_(moved)
