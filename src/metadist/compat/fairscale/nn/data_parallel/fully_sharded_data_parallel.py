"""FairScale's ``FullyShardedDataParallel``: metadist's "zero3", each nested instance a unit.

[Note: the outermost instance sets the model up]
FairScale's users nest instances (``FSDP(Sequential(FSDP(block), FSDP(block), head))``, by
hand or through ``enable_wrap``/``auto_wrap``) and build the optimizer afterwards on
``model.parameters()``. An instance therefore sets nothing up when it is built: the first
call that needs the set-up model (``parameters()``, the forward, a state dict) on an instance
no other instance holds makes it the root, and the root sets its whole tree up under "zero3"
with every nested instance a unit (what runs outside them belongs to the root's unit). The
optimizer the program then builds on ``model.parameters()`` is set up by the strategy at its
first ``step()``, as ``strategy.setup_optimizer`` would.

Options apply per model: the root's. A nested instance whose options differ where it
matters (precision, offload) stops the setup naming the option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

import metadist
from metadist.compat.fairscale._options import check_group, refuse
from metadist.strategies import ownership
from metadist.strategies.activation import hide_in_state_dicts
from metadist.strategies.base import Strategy
from metadist.strategies.module import DistributedModule


@dataclasses.dataclass(frozen=True)
class _Options:
    """The options that decide the strategy (the rest only tune FairScale's own engine)."""

    reshard_after_forward: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    cpu_offload: bool


def _options(where: str, reshard_after_forward: bool, mixed_precision: bool,
             fp32_reduce_scatter: bool, move_params_to_cpu: bool,
             compute_dtype: torch.dtype | None, buffer_dtype: torch.dtype | None,
             move_grads_to_cpu: bool | None, compute_device: torch.device | None,
             force_input_to_fp32: bool, cpu_offload: bool) -> _Options:
    offload = move_params_to_cpu or cpu_offload
    if move_grads_to_cpu is not None and move_grads_to_cpu != offload:
        refuse(where, "move_grads_to_cpu", move_grads_to_cpu,
               "metadist keeps gradients where the shards are: set move_params_to_cpu to the "
               "same value (or leave move_grads_to_cpu unset)")
    device = metadist.init().device
    if compute_device is not None and torch.device(compute_device) != device:
        refuse(where, "compute_device", compute_device,
               f"every rank computes on its own device ({device} here): drop the argument")
    if force_input_to_fp32:
        refuse(where, "force_input_to_fp32", True,
               "inputs reach the model in the dtype the program gives them: cast them itself")
    param_dtype = reduce_dtype = None
    if mixed_precision:
        param_dtype = compute_dtype or torch.float16
        reduce_dtype = torch.float32 if fp32_reduce_scatter else param_dtype
        if buffer_dtype is not None and buffer_dtype != param_dtype:
            refuse(where, "buffer_dtype", buffer_dtype,
                   f"buffers compute in the parameters' dtype ({param_dtype}) under "
                   "mixed_precision: drop buffer_dtype")
    elif compute_dtype is not None and compute_dtype != torch.float32:
        refuse(where, "compute_dtype", compute_dtype,
               "a compute dtype applies with mixed_precision=True: add it")
    return _Options(reshard_after_forward, param_dtype, reduce_dtype, offload)


class FullyShardedDataParallel(nn.Module):
    """``FullyShardedDataParallel(module, process_group=None, reshard_after_forward=True,
    mixed_precision=False, ...)``; see the module notes."""

    def __init__(self, module: nn.Module, process_group: Any = None,
                 reshard_after_forward: bool = True, disable_reshard_on_root: bool = True,
                 mixed_precision: bool = False, fp32_reduce_scatter: bool = False,
                 flatten_parameters: bool = True, move_params_to_cpu: bool = False,
                 compute_dtype: torch.dtype | None = None,
                 buffer_dtype: torch.dtype | None = None,
                 move_grads_to_cpu: bool | None = None, bucket_cap_mb: int = 25,
                 compute_device: torch.device | None = None,
                 no_broadcast_optim_state: bool | None = False,
                 state_dict_device: torch.device | None = None,
                 clear_autocast_cache: bool = False, force_input_to_fp32: bool = False,
                 verbose: bool = False, cpu_offload: bool = False,
                 state_dict_on_rank_0_only: bool = False,
                 gradient_predivide_factor: float | None = None,
                 limit_all_gather_events: bool = False,
                 limit_reduce_scatter_events: bool = False,
                 should_validate_process_group: bool = True) -> None:
        super().__init__()
        check_group(process_group, "FullyShardedDataParallel")
        self.options = _options("FullyShardedDataParallel", reshard_after_forward,
                                mixed_precision, fp32_reduce_scatter, move_params_to_cpu,
                                compute_dtype, buffer_dtype, move_grads_to_cpu,
                                compute_device, force_input_to_fp32, cpu_offload)
        self.module = module
        hide_in_state_dicts(self, "module")  # keys are the wrapped module's, as FairScale's
        self.flatten_parameters = flatten_parameters
        self.state_dict_device = state_dict_device
        self.state_dict_on_rank_0_only = state_dict_on_rank_0_only
        self.__dict__["_root"] = None  # the instance that set this one up (itself: the root)
        self.__dict__["_distributed"] = None

    # ----- the root's setup -----------------------------------------------------------
    @property
    def is_root(self) -> bool | None:
        """True for the instance that set the model up, False for a unit inside it, None
        before setup."""
        root = self.__dict__["_root"]
        return None if root is None else root is self

    def _is_unit(self) -> bool:
        return self.__dict__["_root"] is not None and not self.is_root

    def _set_up(self) -> DistributedModule:
        root: FullyShardedDataParallel | None = self.__dict__["_root"]
        if root is not None and root is not self:
            raise RuntimeError(
                "this FullyShardedDataParallel is a unit inside another one, which set the "
                "model up: call parameters(), state_dict() and the like on the outermost "
                "instance")
        distributed = self.__dict__["_distributed"]
        if distributed is not None:
            return distributed  # type: ignore[no-any-return]
        inner = [m for m in self.module.modules() if isinstance(m, FullyShardedDataParallel)]
        for unit in inner:
            if unit.__dict__["_root"] is not None:
                raise RuntimeError(
                    "a nested FullyShardedDataParallel was already set up on its own (its "
                    "parameters() or forward ran before the outer instance wrapped it): wrap "
                    "the whole model before using any of its instances")
            for option in dataclasses.fields(_Options):
                if getattr(unit.options, option.name) != getattr(self.options, option.name):
                    refuse("FullyShardedDataParallel", option.name,
                           getattr(unit.options, option.name),
                           "metadist applies one set of options per model, the outermost "
                           f"instance's ({getattr(self.options, option.name)!r}): give nested "
                           "instances the same value")
        strategy = metadist.strategy(
            "zero3", wrap_classes=(FullyShardedDataParallel,),
            **{f.name: getattr(self.options, f.name) for f in dataclasses.fields(_Options)})
        distributed = strategy.setup_module(self.module)
        for unit in inner:
            unit.__dict__["_root"] = self
        self.__dict__["_root"] = self
        self.__dict__["_distributed"] = distributed
        self.__dict__["_strategy"] = strategy
        # the optimizer the program builds next, on parameters(): set up at its first step
        ownership.claim([*distributed.parameters(), *distributed.graph_leaves()],
                        strategy.name, "it was built after FullyShardedDataParallel",
                        adopt=partial(strategy.setup_optimizer, distributed))
        return distributed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_unit():
            return self.module(*args, **kwargs)  # a unit: the root's setup gathers it
        return self._set_up()(*args, **kwargs)

    # ----- what the set-up model answers ----------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The user's parameters under their names and shapes (this rank's slice of each)."""
        if self._is_unit():
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        distributed = self._set_up()
        # the user's names: without the set-up module's "module." and the units' own
        units = [f"module.{n}." for n, m in self.module.named_modules()
                 if isinstance(m, FullyShardedDataParallel) and m is not self]
        for inner, p in distributed.named_parameters("", recurse, remove_duplicate):
            name = next((unit + inner[len(unit + "module."):] for unit in units
                         if inner.startswith(unit + "module.")), inner)
            name = name.removeprefix("module.")
            yield (f"{prefix}.{name}" if prefix else name), p

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The whole model's state under the user's names (collective: every rank calls
        it); on ``state_dict_device`` if given, empty on ranks but 0 with
        ``state_dict_on_rank_0_only``."""
        if self._is_unit():  # inside the root's own state dict
            return super().state_dict(*args, **kwargs)
        state = self._set_up().state_dict(*args, **kwargs)
        if self.state_dict_on_rank_0_only and metadist.init().rank != 0:
            return type(state)()
        if self.state_dict_device is not None:
            for key, value in state.items():
                if isinstance(value, Tensor):
                    state[key] = value.to(self.state_dict_device)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        if self._is_unit():
            return super().load_state_dict(state_dict, strict, assign)
        return self._set_up().load_state_dict(state_dict, strict=strict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip every gradient by the norm of the whole model's (every shard counted once)."""
        distributed = self._set_up()
        strategy: Strategy = self.__dict__["_strategy"]
        return strategy.clip_grad_norm_(distributed, float(max_norm), float(norm_type))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside reduces."""
        distributed = self._set_up()
        with self.__dict__["_strategy"].no_sync(distributed):
            yield

    @contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False
                           ) -> Iterator[None]:
        """Inside the block, the module's parameters are whole on every rank (read them;
        with ``volatile=False`` what the block writes is kept)."""
        distributed = self._set_up()
        full = distributed.full_parameters()
        with torch.no_grad():
            originals = {name: p.detach().clone() for name, p in full.items()}
        with distributed.bound(full):
            yield
        if not volatile:
            changed = {k: v for k, v in full.items() if not torch.equal(v, originals[k])}
            if changed:
                distributed.load_state_dict(changed, strict=False)

    def gather_full_optim_state_dict(self, optim: Optimizer, **ignored: Any
                                     ) -> dict[str, Any] | None:
        """The optimizer's whole state on rank 0 (None elsewhere). Collective."""
        self._set_up()
        strategy: Strategy = self.__dict__["_strategy"]
        return strategy.optimizer_state_dict(optim, to=0)

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: dict[str, Any]
                                        ) -> dict[str, Any]:
        """What this rank loads: the whole state (the optimizer keeps its part on load)."""
        return full_optim_state_dict

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


#: FairScale's short name
FSDP = FullyShardedDataParallel

__all__ = ["FSDP", "FullyShardedDataParallel"]
