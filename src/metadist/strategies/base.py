"""The Strategy interface (its registry, ``metadist.strategy(name, **options)``: registry.py).

A strategy turns a user's module, optimizer and data loader into their distributed versions
(``setup``) and owns what happens between forward and ``optimizer.step()``: gradient
synchronisation, accumulation, clipping, metrics. Each strategy lives in its own file with a
frozen dataclass of options; registering it makes its name (and aliases) available.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

import metadist.runtime.world as _world
from metadist.comm import alone, functional, ops
from metadist.comm.ops import ReduceOpName
from metadist.precision import LossScaler, Precision, parse_dtype
from metadist.runtime.world import World
from metadist.strategies import agreement, deferred, ownership, step_chain
from metadist.strategies.activation import CheckpointPolicy, apply_activation_checkpointing
from metadist.strategies.batchnorm import calls as batch_norm_calls
from metadist.strategies.batchnorm import statistics as batch_statistics
from metadist.strategies.compile import compile_setup, take_compile
from metadist.strategies.module import DistributedModule
from metadist.strategies.tensors import grad_norm


def _check_optimizer_matches(model: nn.Module, optimizer: Optimizer) -> None:
    """Every tensor the optimizer steps must be one of the model's parameters: an optimizer
    built on another copy (e.g. before ``copy.deepcopy`` or on a reloaded model) would step
    tensors the strategy never synchronises."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"setup(model, optimizer) takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}; for another kind of optimizer (the "
                        "TorchOpt drop-in's, a functional one) set the model up alone with "
                        "strategy.setup_module(model) and build it on model.parameters()")
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ValueError(
            f"{foreign} tensor(s) in the optimizer are not parameters of the model passed to "
            "setup; build the optimizer from this model's parameters (e.g. "
            "torch.optim.Adam(net.parameters())) and pass both to strategy.setup(net, opt)")


def _check_materialized(model: nn.Module) -> None:
    """Tensors on the meta device hold no values: moving them would fail deep inside torch
    with a message about copies, so say what to do instead."""
    empty = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
             if t.is_meta]
    if empty:
        raise ValueError(
            f"{len(empty)} parameter(s) or buffer(s) of the model are on the meta device and "
            f"hold no values (first: {empty[0]!r}); materialize them before setup: "
            "model.to_empty(device=strategy.device), then initialise them (e.g. each "
            "module's reset_parameters(), or load_state_dict); or build the model under "
            "`with metadist.deferred_init():` and setup materialises it with the values eager "
            "construction gives (zero3/hsdp one unit at a time). A model built under it and "
            "then converted outside it (.double(), .to(dtype)) has lost that record: convert "
            "it inside the block, or after setup")


def _split_union(annotation: str) -> list[str]:
    """``"str | torch.dtype | None"`` -> its alternatives (brackets kept whole)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(annotation):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(annotation[start:i].strip())
            start = i + 1
    parts.append(annotation[start:].strip())
    return parts


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What an option's annotation accepts, and how to say it; an annotation with any other
# alternative (a policy object, a callable) is left to the option's own checks.
_OPTION_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (_is_real, "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "torch.dtype": (lambda v: isinstance(v, torch.dtype), "a torch.dtype"),
    "None": (lambda v: v is None, "None"),
    "tuple[type[nn.Module], ...]": (
        lambda v: isinstance(v, (tuple, list)) and all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in v),
        "a tuple of nn.Module classes (e.g. (nn.TransformerEncoderLayer,))"),
}


def _check_option_type(field: dataclasses.Field[Any], value: Any) -> None:
    """Raise a TypeError naming the option and the type it takes when ``value`` does not fit
    ``field``'s annotation (options whose annotation is not plain data are not checked)."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    kinds = _split_union(annotation)
    if not kinds or any(k not in _OPTION_TYPES for k in kinds):
        return
    if any(_OPTION_TYPES[k][0](value) for k in kinds):
        return
    expected = " or ".join(_OPTION_TYPES[k][1] for k in kinds)
    default = field.default
    example = (f"; e.g. {field.name}={default!r} (the default)"
               if default is not dataclasses.MISSING and default is not None else "")
    raise TypeError(f"strategy option {field.name} must be {expected} ({annotation}), got "
                    f"{value!r} of type {type(value).__name__}{example}")


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """Options every strategy accepts."""

    #: What the model's own forward normalises by on several ranks: True, every rank's batch
    #: together (they are slices of one global batch: BatchNorm layers become metadist's
    #: SyncBatchNorm, CPU and GPU); False, each rank's batch alone (one of its own: a task,
    #: a micro-batch); None (not said) stops at the first such forward and asks. Per-rank
    #: tasks normalise by their own batch either way (strategies/batchnorm/statistics.py).
    sync_batchnorm: bool | None = None
    #: "32-true", "bf16-mixed", "16-mixed" (with a rank-synchronised loss scaler) or
    #: "bf16-true"; see metadist.precision.
    precision: str = "32-true"
    #: dtype gradients are communicated in (e.g. "bfloat16": half the bytes); default: theirs.
    reduce_dtype: str | torch.dtype | None = None
    #: Recompute activations in backward for submodules of these classes (or selected by a
    #: predicate module -> bool); applied before sharding, so it composes with zero3.
    activation_checkpointing: CheckpointPolicy | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_option_type(field, getattr(self, field.name))
        # Validates the name; aliases (Betty's "fp16", "bf16", "fp32") become the mode.
        object.__setattr__(self, "precision", Precision(self.precision).mode)
        parse_dtype(self.reduce_dtype)


class Strategy(ABC):
    """How a training loop runs on many processes. Build one with :func:`metadist.strategy`."""

    name: ClassVar[str] = "?"
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig
    #: Whether ``_setup_module`` materialises a deferred-init model itself, piece by piece
    #: (the sharded strategies); otherwise setup materialises it whole first.
    materializes_by_unit: ClassVar[bool] = False

    def __init__(self, config: StrategyConfig) -> None:
        self.config = config
        self._batch_weight: tuple[float, float] | None = None
        #: The loss scaler of precision="16-mixed" (None otherwise); save it in checkpoints.
        self.scaler: LossScaler | None = (LossScaler() if config.precision == "16-mixed"
                                          else None)
        self._backward_checked = False
        self._share_in_loss = False  # this backward's loss carries the rank's batch share

    @property
    def precision(self) -> Precision:
        """The precision policy on this strategy's device."""
        return Precision(self.config.precision, self.device.type)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.config.reduce_dtype)

    # ----- who and where ---------------------------------------------------------------
    def init(self) -> World:
        """Join the job this process was launched into (:func:`metadist.init` with its
        defaults; idempotent). ``setup``, ``backward``, ``all_reduce``, ``save`` and every
        other method that communicates call it; call it yourself to join earlier."""
        return _world.init()

    @property
    def world(self) -> World:
        """The job's :class:`~metadist.World`. Reading it joins nothing: before the job is
        joined it is answered from the launch environment, exactly as :meth:`init` will
        make it (see ``metadist.runtime.world.peek``)."""
        return _world.peek()

    @property
    def is_global_zero(self) -> bool:
        return self.world.rank == 0

    @property
    def device(self) -> torch.device:
        return self.world.device

    # ----- setup -------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: Optimizer | None = None
              ) -> tuple[DistributedModule, Optimizer]:
        """Move ``model`` to the device, make every rank start from rank 0's weights, wrap it,
        and adapt ``optimizer`` (same class, hyperparameters and state) to the strategy."""
        if isinstance(model, DistributedModule):
            raise ValueError("this model is already set up by a strategy; pass the original "
                             "module (model.module) to setup a second time")
        if optimizer is None:
            raise ValueError("setup(model, optimizer) needs the optimizer; for the module alone "
                             "call strategy.setup_module(model)")
        _check_optimizer_matches(model, optimizer)
        module = self.setup_module(model)  # joins the job
        return module, self.setup_optimizer(module, optimizer)

    def setup_module(self, model: nn.Module) -> DistributedModule:
        """Apply the precision and activation-checkpointing options, then wrap ``model`` for
        this strategy (the forward runs under the precision's autocast). A module compiled
        before setup (``torch.compile(model)``, ``model.compile()``) is set up uncompiled and
        the set-up model compiled with the same options (see strategies/compile.py)."""
        self.init()
        model, compiled = take_compile(model)
        agreement.check_not_set_up(model)
        agreement.agree(f"setup under {self.name!r}",
                        [*agreement.options_items(self.name, self.config),
                         *agreement.module_items(model)],
                        "Build the same model with the same strategy options on every rank "
                        "(a per-rank configuration or a rank-dependent branch makes them "
                        "differ)")
        log = deferred.log_of(model)
        if log is None:
            _check_materialized(model)
        precision = self.precision
        precision.check()
        with deferred.recording(log):  # a deferred model converts without allocating
            model = precision.convert_module(model)
        if log is not None and not self.materializes_by_unit:
            deferred.materialize(model, log)
        if self.config.activation_checkpointing is not None:
            model = apply_activation_checkpointing(model, self.config.activation_checkpointing)
        module = self._setup_module(model)
        batch_statistics.ask_for_the_choice(module.module, self.config.sync_batchnorm,
                                            self.name, self._batch_parts(module))
        batch_statistics.weigh_by(module.module, self.batch_share)
        parts = self._batch_parts(module)
        batch_norm_calls.watch(module.module, self.config.sync_batchnorm, self.name, parts,
                               self.batch_share, combine=parts == self.world.world_size)
        module.precision = precision
        if compiled is not None:
            compile_setup(module, compiled)
        if module.split_gradients():  # torch's clip_grad_norm_ & co. must see the parts
            grad_norm.track(module)
        agreement.mark_set_up(module.module, self.name)
        ownership.claim([*module.parameters(), *module.graph_leaves()], self.name,
                        self._optimizer_needed())
        return module

    def _batch_parts(self, module: DistributedModule) -> int:
        """Into how many parts a forward's batch is split, each normalised apart by a plain
        BatchNorm: the ranks."""
        return self.world.world_size

    def _optimizer_needed(self) -> str | None:
        """Why an optimizer stepping this strategy's parameters must go through
        :meth:`setup_optimizer` (None: any optimizer steps them exactly)."""
        if self.scaler is not None:
            return ('precision="16-mixed" scales the loss, and only an optimizer set up by '
                    "the strategy unscales the gradients and skips steps that overflow")
        return None

    def setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        """Adapt ``optimizer``, built on ``module.module``'s parameters, to this strategy."""
        if not isinstance(module, DistributedModule):
            raise TypeError("setup_optimizer(module, optimizer) needs the module returned by "
                            "strategy.setup_module(model); or call strategy.setup(model, "
                            "optimizer) for both")
        step_chain.check_not_set_up(optimizer)
        self.init()
        agreement.agree(f"setup_optimizer under {self.name!r}",
                        agreement.optimizer_items(optimizer),
                        "Build the same optimizer, with the same hyperparameters and param "
                        "groups, on every rank (a per-rank configuration makes them differ; a "
                        "rank-dependent learning rate trains each rank's part differently)")
        try:
            optimizer = self._setup_optimizer(module, optimizer)  # fills the strategy's phases
            chain = step_chain.building(optimizer)
            if self.world.world_size > 1:  # hyperparameters and step count, every step
                chain.add("agree", agreement.StepAgreement(optimizer, self.name))
            if self.scaler is not None:
                chain.add("unscale", functools.partial(self.scaler.before_step, optimizer))
                chain.add("update_scale", self.scaler.after_step)
            if module.running_stats():  # the ranks' own batches' updates, combined
                chain.add("running_stats", module.sync_running_stats)
        except BaseException:
            step_chain.discard(optimizer)
            raise
        step_chain.install(optimizer)  # one pre- and one post-step hook, phases in order
        return optimizer

    @abstractmethod
    def _setup_module(self, model: nn.Module) -> DistributedModule:
        """Wrap ``model`` (already converted for precision) for this strategy."""

    @abstractmethod
    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        """The strategy's own optimizer adaptation: sharding, and the phases of
        ``step_chain.building(optimizer)`` it owns (see strategies/step_chain.py)."""

    def setup_dataloader(self, loader: DataLoader[Any], *, seed: int | None = 0,
                         dataset_shards_itself: bool = False) -> DataLoader[Any]:
        """Re-create ``loader`` so each rank reads its share of every global batch.

        Each epoch's order comes from the loader's sampler seeded with ``seed + epoch``;
        ``seed=None`` draws it from the global random state as torch's own loader would
        (one process then reads exactly the batches of the loader as given; see
        metadist/data.py).

        An IterableDataset cannot be split by index: shard it inside the dataset (by
        ``metadist.world().rank``) and pass ``dataset_shards_itself=True`` to keep the
        loader as it is; without it, an IterableDataset on several ranks is an error.
        """
        from metadist.data import distribute_loader

        w = self.init()
        agreement.agree("setup_dataloader", agreement.loader_items(loader, dataset_shards_itself),
                        "Give every rank the whole dataset and the same loader settings: "
                        "setup_dataloader gives each rank its share of every global batch")
        return distribute_loader(loader, rank=w.rank, world_size=w.world_size, seed=seed,
                                 on_batch=self.set_batch_weight,
                                 dataset_shards_itself=dataset_shards_itself)

    def split_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's contiguous slice of each tensor (one global batch along dimension 0),
        with the next gradient sync weighted by the slice's share of the batch: a mean loss
        over the slice then gives one process's mean over the whole batch, also where the
        batch does not divide by the ranks (6 samples on 4 ranks: 2, 2, 1, 1)."""
        w = self.world
        lengths = {t.shape[0] if t.dim() else None for t in tensors}
        if not tensors or None in lengths or len(lengths) != 1:
            raise ValueError(
                "split_batch(*tensors) takes the tensors of one global batch, each with the "
                "samples along dimension 0 and as many of them; got lengths "
                f"{sorted(map(str, lengths))}")
        total = int(lengths.pop())  # type: ignore[arg-type]
        if total < w.world_size:
            raise ValueError(
                f"split_batch: a global batch of {total} sample(s) on {w.world_size} ranks "
                "leaves a rank without samples: give every rank at least one (a global batch "
                "of at least world_size), or read batches through setup_dataloader, whose "
                "empty ranks read a stand-in sample of weight 0")
        mine = tuple(torch.tensor_split(t, w.world_size)[w.rank] for t in tensors)
        self.set_batch_weight(mine[0].shape[0], total)
        return mine

    # ----- the step ----------------------------------------------------------------------
    def set_batch_weight(self, local: float, total: float) -> None:
        """Weight the next gradient sync by this rank's share of the global batch.

        The distributed loader calls this for every batch, so a ragged last batch still
        yields the single-process mean; custom loaders may call it themselves.
        """
        if total <= 0 or local < 0:
            raise ValueError(f"batch weight needs 0 <= local and total > 0, got {local}/{total}")
        self._batch_weight = (float(local), float(total))

    def grad_scale(self) -> float:
        """Factor applied to this rank's gradients before they are summed across ranks."""
        if self._batch_weight is None:
            return 1.0 / self.world.world_size
        local, total = self._batch_weight
        return local / total

    def reduce_factor(self) -> float:
        """Factor the gradient reducers apply to this rank's gradients before summing them:
        :meth:`grad_scale`, or 1 while a 16-mixed backward's loss carries it already."""
        return 1.0 if self._share_in_loss else self.grad_scale()

    def batch_share(self) -> float:
        """This rank's share of the global batch relative to an even split: exactly 1.0
        where the ranks hold as many samples each, 0 for a stand-in batch."""
        if self._batch_weight is None:
            return 1.0
        local, total = self._batch_weight
        even = local * self.world.world_size
        return 1.0 if even == total else even / total

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, scaled under precision="16-mixed" (where it is required);
        with other precisions plain ``loss.backward()`` works too.

        On more than one rank the first call (every call in debug mode) checks that the
        gradient reaches a module this or another strategy set up and no ``nn.Parameter``
        outside one: those gradients would stay local and the ranks would drift apart."""
        if not self._backward_checked or ops.debug_enabled():
            if self.init().world_size > 1:
                ownership.check_backward(loss, kwargs.get("inputs"), self.name)
            self._backward_checked = True
        share = self.grad_scale()
        if self.scaler is None or share == 0.0:  # a stand-in batch: the reducer zeroes it
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            loss.backward(*args, **kwargs)
            return
        # [Note: 16-mixed scales by the share] The loss carries the scale times this rank's
        # share of the global batch and the reducers sum: float16 then holds each sample's
        # gradient at the magnitude one process's global-batch backward gives it, so it
        # overflows where one process's does (a local mean at the full scale is N times
        # larger, and overflows first).
        self._share_in_loss = True
        try:
            self.scaler.scale(loss, share).backward(*args, **kwargs)
        finally:
            self._share_in_loss = False

    @contextmanager
    def no_sync(self, module: DistributedModule) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside syncs."""
        yield

    def clip_grad_norm_(self, module: DistributedModule, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the synchronised gradients to ``max_norm``; returns the global norm.

        Under "16-mixed" the gradients still carry the loss scale here: clipping them to
        ``max_norm * scale`` is the same clip, and the norm is reported unscaled.
        """
        self.init()
        scale = self.scaler.current_scale() if self.scaler is not None else 1.0
        return self._clip_grad_norm(module, max_norm * scale, norm_type) / scale

    def _clip_grad_norm(self, module: DistributedModule, max_norm: float,
                        norm_type: float) -> torch.Tensor:
        params = [p for p in module.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def all_reduce(self, value: torch.Tensor | float, op: ReduceOpName = "mean") -> torch.Tensor:
        """Reduce a metric across ranks (returns a new tensor on the strategy's device)."""
        self.init()
        t = torch.as_tensor(value, device=self.device).detach().clone()
        if not t.is_floating_point() and op == "mean":
            t = t.double()
        ops.all_reduce(t, op)
        return t

    def sync_grads(self, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Average a tuple of gradients (e.g. from ``torch.autograd.grad``) across ranks,
        differentiably, so hypergradient code stays exact; see ``comm.functional``."""
        self.init()
        present = [g for g in grads if g is not None]
        scale = self.grad_scale()
        reduced = iter(functional.all_reduce_many([g * scale for g in present], "sum"))
        return tuple(next(reduced) if g is not None else g for g in grads)

    def optimizer_state_dict(self, optimizer: Optimizer, to: int | None = None
                             ) -> dict[str, Any] | None:
        """The optimizer's full state in the plain single-process format, consolidated from
        every rank's shard. Collective; returned on every rank, or only on rank ``to``.
        (``optimizer.state_dict()`` is this rank's shard; ``load_state_dict`` takes either.)"""
        from metadist.strategies.sharded_optim import full_state_dict

        self.init()
        with alone.collective_call("strategy.optimizer_state_dict()"):
            return full_state_dict(optimizer, to)

    # ----- checkpoints -------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], state: dict[str, Any], *,
             format: str = "sharded") -> None:
        """Save ``state`` (module, optimizer, scheduler, scaler, loader, plain values) to
        ``path``: ``"sharded"`` (every rank writes its shard) or ``"full"`` (one file from
        rank 0). Collective; atomic. See :mod:`metadist.checkpoint`."""
        from metadist import checkpoint

        self.init()
        checkpoint.save(self, path, state, format=format)

    def load(self, path: str | os.PathLike[str], state: dict[str, Any]) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint of either format, written by any
        strategy at any world size; returns the plain values it held. Collective."""
        from metadist import checkpoint

        self.init()
        return checkpoint.load(self, path, state)

    def barrier(self) -> None:
        self.init()
        ops.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.init()
        return ops.broadcast_object(obj, src)

    def __repr__(self) -> str:
        options = ", ".join(f"{f.name}={getattr(self.config, f.name)!r}"
                            for f in dataclasses.fields(self.config))
        return f"metadist.strategy({self.name!r}{', ' if options else ''}{options})"
