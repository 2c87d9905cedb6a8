"""FairScale's ``OSS``: a sharded optimizer, as metadist's zero1/zero2 optimizer.

[Note: OSS is bound by the model's wrapper]
FairScale builds the optimizer before the model's wrapper and hands it to
``ShardedDataParallel(model, optimizer)``; metadist sets a model and its optimizer up
together. So an ``OSS`` holds the base optimizer (built on the parameters, as one process's)
until a ``ShardedDataParallel`` sets both up under "zero2" and binds it; from then on the base
optimizer steps each parameter on its owner rank and refreshes the others. ``param_groups``
and ``state`` are the base optimizer's own, so a learning-rate scheduler built on the OSS
changes what steps. An OSS never bound (beside torch's DDP, whose gradients are already
averaged) steps every parameter on every rank: the same numbers, the state not sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import SGD, Optimizer

import metadist
from metadist.comm import alone
from metadist.compat.fairscale._options import check_group, refuse
from metadist.strategies.base import Strategy
from metadist.strategies.module import DistributedModule


class OSS(Optimizer):
    """``OSS(params, optim=torch.optim.SGD, group=None, **defaults)``: the optimizer state
    sharded over the ranks (ZeRO); see the module notes."""

    optim: Optimizer

    def __init__(self, params: Iterable[Any], optim: type[Optimizer] = SGD,
                 group: Any | None = None, broadcast_buffer_size: int = -1,
                 broadcast_fp16: bool = False, force_broadcast_object: bool = False,
                 **default: Any) -> None:
        check_group(group, "OSS")
        if broadcast_fp16:
            refuse("OSS", "broadcast_fp16", True,
                   "metadist refreshes parameters in their own dtype; drop the option (for "
                   "half the gradient traffic, ShardedDataParallel(reduce_fp16=True))")
        params = list(params)
        self.optim = optim(params, **default)
        self._constructed = False
        super().__init__(params, self.optim.defaults)
        self._constructed = True
        # One set of groups and state: the base optimizer's (the module notes).
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._optim_constructor, self._optim_defaults = optim, default
        world = metadist.init()
        self.group = dist.group.WORLD
        self.world_size, self.rank = world.world_size, world.rank
        self.global_rank = self.rank
        self.backend = world.backend
        self._strategy: Strategy | None = None
        self._module: DistributedModule | None = None
        self._consolidated: dict[str, Any] | None = None

    def _bind(self, strategy: Strategy, module: DistributedModule) -> None:
        self._strategy, self._module = strategy, module

    @property
    def is_bound(self) -> bool:
        """Whether a ShardedDataParallel set this optimizer up (its state is then sharded)."""
        return self._strategy is not None

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        return self.optim.step(closure, **kwargs) if closure is not None else \
            self.optim.step(**kwargs)

    # the base optimizer runs the step hooks (metadist's phases among them), not the OSS
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._constructed:  # Optimizer.__init__'s own calls (replaced below)
            super().add_param_group(param_group)
            return
        self.optim.add_param_group(param_group)

    def refresh_trainable(self) -> None:
        """Nothing to rebuild: metadist reads ``requires_grad`` at every backward and step,
        so freezing or unfreezing a parameter takes effect at once."""

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       filter_params_fn: Callable[[Any], Any] | None = None) -> torch.Tensor:
        """Clip every gradient by the norm of them all (every rank's part counted once)."""
        if filter_params_fn is not None:
            refuse("OSS.clip_grad_norm", "filter_params_fn", filter_params_fn,
                   "metadist has no model-parallel parameters to filter: drop the argument")
        if self._strategy is not None and self._module is not None:
            return self._strategy.clip_grad_norm_(self._module, float(max_norm),
                                                  float(norm_type))
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, float(max_norm), float(norm_type))

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the whole optimizer state on ``recipient_rank`` (-1: on every rank) for
        :meth:`state_dict`. Collective: call it on every rank."""
        if self._strategy is None:
            self._consolidated = self.optim.state_dict()
            return
        to = None if recipient_rank == -1 else recipient_rank
        with alone.collective_call("OSS.consolidate_state_dict()"):
            self._consolidated = self._strategy.optimizer_state_dict(self.optim, to=to)

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The whole state gathered by :meth:`consolidate_state_dict`, in torch's format
        (what one process's optimizer saves)."""
        if all_ranks and self._strategy is not None:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._consolidated is None:
            raise RuntimeError(
                "OSS.state_dict(): the optimizer state is spread over the ranks and was not "
                f"gathered on rank {self.rank}: call optimizer.consolidate_state_dict() on "
                "every rank first (it gathers on rank 0; recipient_rank=-1 on every rank), "
                "then optimizer.state_dict() on the recipient")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (one process's or a consolidated one): each rank keeps its
        part."""
        self.optim.load_state_dict(state_dict)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def __repr__(self) -> str:
        return f"OSS({self.optim!r}, sharded={'zero2' if self.is_bound else 'no'})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an OSS optimizer holds the job's process group and cannot be pickled; "
                        "save optimizer.state_dict() after consolidate_state_dict()")


__all__ = ["OSS"]
