"""The module every strategy returns from ``setup``: the user's module plus the strategy's
forward-time duties, and a uniform way to run it with explicit ("fast") weights.

Meta-learning code never needs to know how parameters are laid out across ranks:
``full_parameters()`` gives name -> tensor for every trainable parameter of the user's module,
differentiable with respect to what the optimizer steps, and ``functional_forward(params, ...)``
runs the module with any such dictionary (e.g. weights adapted in an inner loop).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from metadist.precision import Precision
from metadist.strategies.batchnorm.calls import copy_running
from metadist.strategies.batchnorm.running_stats import LEDGERS, RunningStats
from metadist.strategies.bind import bind_parameters
from metadist.strategies.compile import call, compile_call, pieces
from metadist.strategies.cooperative import cooperating
from metadist.strategies.fast_weights import FastWeights, ReplicatedLayout, weigh_slice
from metadist.strategies.placement import ModulePlacement, replicated_module
from metadist.strategies.tensors.grad_norm import Split

#: the modules strategies returned from setup; a copy of one (learn2learn's clone, higher's
#: patched module, copy.deepcopy) is not among them, and runs a per-rank task
_SET_UP: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class DistributedModule(nn.Module):
    """Wraps ``module``; ``state_dict``/``load_state_dict`` speak the user's module's keys."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        #: set by the strategy: autocast and input/output casts around every forward
        self.precision = Precision()
        self._probe: list[torch.Tensor | None] | None = None  # a list: no submodule registration
        #: (name, owning module, local name, parameter) of every parameter, for full_parameters
        self._param_slots: list[tuple[str, nn.Module, str, Any]] | None = None
        #: loads through a parent in progress: (prefix, torch's error list, its length before)
        self._loading: list[tuple[str, list[str], int]] = []
        self._fast_layout: Any = None  # fast_weights()' layout, one per module
        self._register_load_state_dict_pre_hook(DistributedModule._nest_keys, with_module=True)
        self.register_load_state_dict_post_hook(DistributedModule._unnest_keys)
        _SET_UP.add(self)

    def is_set_up(self) -> bool:
        """Whether this is the module setup returned, not a copy of it (a copy runs each
        rank's own task: no collective of the strategy runs in its forward)."""
        return self in _SET_UP

    def _apply(self, fn: Any, recurse: bool = True) -> DistributedModule:
        """``model.to(device)``, ``.cpu()``, ``.float()`` on a float model: as on a plain
        module. A conversion to another dtype stops before it changes anything where the
        strategy built state for the dtype at setup (:meth:`_dtype_bound_state`), which would
        not follow: the next backward would fail far from the call, or train on mixed
        dtypes."""
        bound = self._dtype_bound_state()
        floating = {(t.dtype, t.device) for t in (*self.parameters(), *self.graph_leaves(),
                                                  *self.buffers())
                    if t.is_floating_point()} if bound is not None else set()
        for dtype, device in sorted(floating, key=str):
            to = fn(torch.empty(0, dtype=dtype, device=device)).dtype
            if to != dtype:
                raise RuntimeError(
                    f"converting the set-up model's {dtype} tensors to {to} after setup is "
                    f"not supported here: the strategy built its {bound} for {dtype}, and "
                    f"they would not follow. Convert the module before setup "
                    f"(net.to({to}), then strategy.setup(net, optimizer)), or compute in "
                    "lower precision with the strategy's precision option (e.g. "
                    "metadist.strategy(..., precision='bf16-mixed'))")
        super()._apply(fn, recurse)
        return self

    def _dtype_bound_state(self) -> str | None:
        """What of the strategy's state was built for the parameters' dtype at setup and
        would not follow a conversion (None: nothing, a conversion works as on a plain
        module)."""
        return None

    def __getattr__(self, name: str) -> Any:
        # Attributes of the user's module (``model.vocab_size``, ``model.encode(...)``) read
        # through the wrapper as on a plain module; the wrapper's own come first.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__["_modules"].get("module")
            if inner is None or name.startswith("_"):
                raise
            value = getattr(inner, name)
            return value

    # A container module (nn.Sequential, ModuleList, ModuleDict) reads as itself through the
    # wrapper: indexing, length, iteration and truthiness are the user's module's (each
    # raises TypeError where the user's module has none, as on a plain module).
    def __getitem__(self, key: Any) -> Any:
        return self._user_module("subscriptable")[key]

    def __len__(self) -> int:
        return len(self._user_module("sized"))

    def __iter__(self) -> Iterator[Any]:
        out: Iterator[Any] = iter(self._user_module("iterable"))
        return out

    def __bool__(self) -> bool:
        # (a patched copy under construction, e.g. higher's, may not hold the module yet)
        inner = self.__dict__.get("_modules", {}).get("module")
        return True if inner is None else bool(inner)

    def _user_module(self, what: str) -> Any:
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is None:
            raise TypeError(f"'{type(self).__name__}' object is not {what}")
        return inner

    def pre_forward(self) -> None:
        """Per-forward work of the strategy (e.g. buffer broadcast). Default: nothing."""

    def pre_functional_forward(self) -> None:
        """Work before a forward on given parameters (:meth:`functional_forward`). Default:
        :meth:`pre_forward`."""
        self.pre_forward()

    def wait_params(self) -> None:
        """Finish any in-flight parameter refresh (zero1/zero2 overlap it with the next
        forward). Reads through this wrapper wait by themselves; call it before reading
        ``model.module``'s parameters directly right after ``optimizer.step()``."""

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` under this module's precision policy."""
        policy = self.precision
        self._check_devices(args)
        if policy.mode == "32-true":  # nothing to cast or autocast: the cheapest forward
            return fn(*args, **kwargs)
        args, kwargs = policy.cast_inputs((args, kwargs))
        with policy.autocast():
            out = fn(*args, **kwargs)
        return policy.cast_outputs(out)

    def _check_devices(self, args: tuple[Any, ...]) -> None:
        """A CPU batch fed to a GPU model (or the reverse) fails deep inside the first layer
        with a message about the op; say which tensor and what to do instead."""
        for first in args:
            if isinstance(first, torch.Tensor):
                break
        else:
            return
        if self._probe is None:  # one parameter, found once: forwards stay cheap
            # (a parameter, not a tensor bound in its place: the probe keeps it alive)
            self._probe = [next((p for p in self.module.parameters()
                                 if isinstance(p, nn.Parameter)), None)]
        param = self._probe[0]
        if param is None or first.device.type == param.device.type:
            return
        if param.device.type != "meta":
            raise RuntimeError(
                f"the input is on {first.device} but the model is on {param.device}; move "
                "batches with x.to(strategy.device) (or let strategy.setup_dataloader's "
                "loader feed the model)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.is_set_up():
            with copy_running():
                return self.run(self.module, args, kwargs)
        self.pre_forward()
        return self.run(self.module, args, kwargs)

    def running_stats(self) -> RunningStats | None:
        """The record of the ranks' own batches' updates of running statistics (None where
        one rank computes, or the batch parts are not ranks)."""
        ledger = LEDGERS.get(self.module)
        return ledger if ledger else None

    def sync_running_stats(self) -> None:
        """Combine every rank's updates of the running statistics since the last optimizer
        step, as one process running the ranks' batches in rank order makes them
        (strategies/batchnorm/running_stats.py). Collective: every rank calls it. The step of an
        optimizer set up by the strategy calls it."""
        ledger = self.running_stats()
        if ledger is not None:
            ledger.sync()

    # torch.compile: the strategy's work stays eager, compile_pieces() are compiled
    __call__ = call

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` this model in place (``nn.Module.compile``), with metadist's
        compile boundaries (docs/compile.md)."""
        compile_call(self, lambda fn: torch.compile(fn, *args, **kwargs))

    def compile_pieces(self) -> list[nn.Module]:
        """The modules whose forward runs compiled when this model is compiled (see
        strategies/compile.py): the user's module whole, where the strategy has no work
        inside it (bar layers that run eagerly, e.g. SyncBatchNorm)."""
        return pieces(self.module, set())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter of the user's module, by its own name, as a tensor that
        gradients flow through back to what the optimizer steps."""
        slots = self._param_slots
        if slots is not None:  # valid while every parameter is still the object found
            out: dict[str, torch.Tensor] = {}
            for name, owner, local, param in slots:
                current = owner._parameters.get(local)
                if current is not param or current is None:
                    break
                if current.requires_grad:
                    out[name] = current
            else:
                return out
        # named_parameters' walk costs ~40 us a call on a small model; meta-learning calls
        # this several times a step, so remember where each parameter lives.
        slots, seen = [], set()
        for prefix, owner in self.module.named_modules():
            for local, param in owner._parameters.items():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    slots.append((f"{prefix}.{local}" if prefix else local, owner, local,
                                  param))
        self._param_slots = slots
        return {n: p for n, _, _, p in slots if p.requires_grad}

    def fast_weights(self) -> FastWeights:
        """The trainable parameters as fast weights of a *cooperative* inner problem, one
        whose batch the ranks split and whose fast weights they share (strategies/
        fast_weights.py). Here they are whole; zero3/hsdp keep them as shards."""
        full = self.full_parameters()
        if self._fast_layout is None or self._fast_layout.names != tuple(full):
            reducer = getattr(self, "reducer", None)
            self._fast_layout = ReplicatedLayout(list(full), reducer.scale
                                                 if reducer is not None else None)
        return FastWeights(self._fast_layout, tuple(full.values()))

    def plain_module(self) -> nn.Module:
        """A plain module computing what this one computes on this rank, with parameters
        gradients flow through back to what the optimizer steps: the user's module itself
        (its parameters current) where every rank holds them whole; a copy built from
        :meth:`full_parameters` where ranks hold shards. For clones (``module_clone``)."""
        self.wait_params()
        return self.module

    def functional_forward(self, params: Mapping[str, torch.Tensor] | FastWeights, *args: Any,
                           **kwargs: Any) -> Any:
        """Run the module with ``params`` (names as in :meth:`full_parameters`, or the fast
        weights of :meth:`fast_weights`) in place of its own; parameters and buffers not
        named keep their current values. A name the module does not have raises (rather
        than being ignored)."""
        if isinstance(params, FastWeights):
            with cooperating(None, params.layout.group_size()):
                out = self.functional_forward(params.full(), *args, **kwargs)
            return weigh_slice(params.layout, out, args, kwargs)
        self.pre_functional_forward()
        with bind_parameters(self.module, params, task=True):
            return self.run(self.module, args, kwargs)

    def bound(self, params: Mapping[str, torch.Tensor] | FastWeights
              ) -> AbstractContextManager[Any]:
        """A block within which the user's module holds ``params`` (names as in
        :meth:`full_parameters`; buffers too) in place of its own, for every path that
        reaches them: forwards, the module's methods and attributes, ``named_parameters()``,
        ``state_dict()``, as an in-place change of a plain module's parameters would show;
        restored on exit. The meta engine runs a problem's whole computation in one."""
        self.wait_params()
        if isinstance(params, FastWeights):  # whole tensors here
            return _bound_fast(self.module, params)
        return bind_parameters(self.module, params)

    def split_gradients(self) -> dict[torch.Tensor, Split]:
        """Parameters whose ``.grad`` on this rank is only a part of the gradient one process
        computes, and how the parts add up (zero2, zero3, hsdp); torch's gradient utilities
        read it (strategies/tensors/grad_norm.py). Default: none, every gradient is whole."""
        return {}

    def graph_leaves(self) -> list[torch.Tensor]:
        """The leaf tensors a backward through this module accumulates into, which a set-up
        optimizer steps: ``parameters()``, except under zero3/hsdp (the flat shards behind
        them)."""
        return list(self.parameters())

    def placements(self) -> ModulePlacement:
        """Where each tensor of the user's module's state dict lives on this rank
        (strategies/placement.py). Default: every rank holds it whole."""
        return replicated_module(self, self.module, keep_vars=True)

    # ----- state dicts: the user's module's, also when this module sits in another ------
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        # A parent's state_dict calls this with its destination and prefix: the entries are
        # the user's module's under that prefix, as if it sat there itself.
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        self.wait_params()  # a refresh in flight must not land on the loaded values
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _nest_keys(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                   strict: bool, missing: list[str], unexpected: list[str],
                   error_msgs: list[str]) -> None:
        """Pre-hook of a load through a parent (``outer.load_state_dict``, a compiled
        model's): torch walks into ``self.module`` under ``prefix + "module."``, while the
        keys, as :meth:`state_dict` writes them, sit right under ``prefix``."""
        self.wait_params()
        inner = prefix + "module."
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
        self._loading.append((prefix, error_msgs, len(error_msgs)))

    def _unnest_keys(self, incompatible: Any) -> None:
        """Post-hook of that load: report keys as the dict spells them, and nothing about
        this wrapper's own machinery (zero3's ``shards``)."""
        prefix, error_msgs, start = self._loading.pop()
        inner = prefix + "module."
        machinery = tuple(f"{prefix}{name}." for name in self._modules if name != "module")
        for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
            keys[:] = [prefix + k[len(inner):] if k.startswith(inner) else k
                       for k in keys if not k.startswith(machinery)]
        for i in range(start, len(error_msgs)):
            error_msgs[i] = re.sub(rf"(?<![\w.]){re.escape(inner)}", lambda _: prefix,
                                   error_msgs[i])


@contextmanager
def _bound_fast(module: nn.Module, fast: FastWeights) -> Iterator[None]:
    """A cooperative problem's computation on whole fast weights."""
    with cooperating(None, fast.layout.group_size()), bind_parameters(module, fast.full()):
        yield
