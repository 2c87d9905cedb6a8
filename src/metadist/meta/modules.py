"""Modules whose parameters are tensors of an autograd graph: cloning, snapshots, restores
and functional calls.

How parameters that are not leaves live in a module
----------------------------------------------------
After a differentiable step a parameter is ``p - lr * g``: a non-leaf tensor, not an
``nn.Parameter``. metadist writes such tensors straight into the owning module's
``_parameters`` dict (``nn.Module.__setattr__`` would refuse them): strategies/bind.py's
``rebind_parameters`` writes them there, where ``bind_parameters`` swaps tensors for one
forward. Deleting the entry and setting a plain attribute instead would hide the tensor
from ``named_parameters()``, ``state_dict()``, ``DistributedModule.full_parameters()`` and
the next optimiser step. Keeping it in ``_parameters`` keeps all of those working, keeps
the module's class, and a tied weight stays one entry: every (module, name) slot that held
the same tensor receives the same new tensor.
``recover_state_dict`` puts the original leaves back. (Avoid ``module.to(...)`` while
non-leaf parameters are in place: it would wrap them back into detached leaves.)

Under a strategy, pass the wrapped model (what ``strategy.setup`` returned), not
``model.module``: zero1/zero2 refresh parameters asynchronously after ``optimizer.step()`` and
the wrapper waits for that refresh before anything here reads a parameter. Strategies that
shard parameters (zero3, hsdp) keep no full parameters in the module: ``module_clone`` of the
wrapped model there is a copy of the user's module on the full parameters (differentiable
into the shards), so a clone per task with a meta-optimiser works as under ddp; the tools
that would change the wrapped model in place (a meta-optimiser bound to it,
``extract_state_dict``/``recover_state_dict``) raise and point to ``module_clone`` or to
``model.full_parameters()`` with the functional optimisers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from metadist.strategies.bind import bind_parameters, rebind_parameters
from metadist.strategies.module import DistributedModule

By = Literal["reference", "copy", "deepcopy"]
BY_CHOICES = ("reference", "copy", "deepcopy")
ParamUse = tuple[nn.Module, str]
M = TypeVar("M", bound=nn.Module)


def _check_by(by: str) -> None:
    if by not in BY_CHOICES:
        raise ValueError(f"by={by!r} is not known; choose one of: {', '.join(BY_CHOICES)} "
                         "(share tensors, clone inside the graph, or detached copies)")


def iter_slots(module: nn.Module, kind: Literal["_parameters", "_buffers"]
               ) -> Iterator[tuple[str, nn.Module, str, Tensor]]:
    """``(qualified name, owning module, local name, tensor)`` for every parameter or buffer
    slot, tied and shared entries included (unlike ``named_parameters``)."""
    seen: set[tuple[int, str]] = set()
    for prefix, owner in module.named_modules(remove_duplicate=False):
        entries: dict[str, Tensor | None] = getattr(owner, kind)
        for local, tensor in entries.items():
            if tensor is None or (id(owner), local) in seen:
                continue
            seen.add((id(owner), local))
            yield (f"{prefix}.{local}" if prefix else local), owner, local, tensor


def trainable_slots(module: nn.Module) -> list[tuple[str, list[ParamUse]]]:
    """One entry per distinct trainable parameter, in ``named_parameters()`` order and under
    its first name, with every slot that holds it (several when weights are tied)."""
    by_tensor: dict[int, tuple[str, list[ParamUse]]] = {}
    for name, owner, local, tensor in iter_slots(module, "_parameters"):
        if tensor.requires_grad:
            by_tensor.setdefault(id(tensor), (name, []))[1].append((owner, local))
    return list(by_tensor.values())


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module behind a strategy's wrapper, its parameters current; other modules
    as they are. Raises when the strategy keeps the full parameters outside the module."""
    if not isinstance(module, DistributedModule):
        return module
    full = module.full_parameters()  # waits for parameter refreshes still in flight
    own = dict(module.module.named_parameters())
    if any(own.get(name) is not tensor for name, tensor in full.items()):
        raise ValueError(f"this strategy's module ({type(module).__name__}) holds parameter "
                         "shards, not full parameters, so it cannot be changed in place; bind "
                         "the meta-optimiser to a clone (module_clone(model, by='copy'), which "
                         "holds the full parameters), or adapt model.full_parameters() with the "
                         "functional optimisers (metadist.meta.sgd/adam/adamw) and run "
                         "model.functional_forward(params, ...) instead")
    return module.module


def _converter(by: str, detach_buffers: bool) -> Callable[[Tensor, bool], Tensor]:
    """How one tensor is taken over by ``by`` (``is_param`` tells parameters from buffers)."""
    _check_by(by)

    def convert(t: Tensor, is_param: bool) -> Tensor:
        if not is_param and (detach_buffers or by == "deepcopy"):
            return t.detach() if by == "reference" else t.detach().clone()
        if by == "reference":
            return t
        if by == "copy":
            if not is_param and not t.requires_grad:
                return t  # shared: running statistics update the original's (learn2learn's)
            return t.clone()  # a non-leaf: gradients reach the original through the clone
        return nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)

    return convert


def _converted(module: nn.Module, by: str, detach_buffers: bool, with_buffers: bool
               ) -> Iterator[tuple[str, Tensor, Tensor]]:
    """``(name, original, converted)``; a tensor held by several slots converts once, so
    tied weights stay tied in the result."""
    convert = _converter(by, detach_buffers)
    done: dict[int, Tensor] = {}
    kinds: tuple[Literal["_parameters", "_buffers"], ...] = (
        ("_parameters", "_buffers") if with_buffers else ("_parameters",))
    for kind in kinds:
        for name, _, _, tensor in iter_slots(module, kind):
            if id(tensor) not in done:
                done[id(tensor)] = convert(tensor, kind == "_parameters")
            yield name, tensor, done[id(tensor)]


def module_clone(module: M, *, by: By = "reference", detach_buffers: bool = False) -> M:
    """A new module of the same structure whose parameters are taken over ``by``:

    * ``"reference"``: the very same tensors (cheap; a meta-optimiser stepping the clone
      rebinds the clone's slots and leaves the original module untouched);
    * ``"copy"``: clones inside the autograd graph, so a loss on the clone sends gradients to
      the original's parameters (one clone per task in MAML);
    * ``"deepcopy"``: detached, independent ``nn.Parameter`` copies (buffers too).

    Buffers follow ``by`` too, except that ``"copy"`` shares the buffers no gradient flows
    through (as learn2learn's ``clone_module`` does): a clone's BatchNorm updates the
    original's running statistics, as the original's own forward on the task would. They are
    detached copies when ``detach_buffers=True`` (a clone whose buffers are its own). Tied weights
    stay tied. Hooks and other attributes are deep-copied as ``copy.deepcopy`` does. A
    strategy's wrapped model clones to a copy of the user's module (see the module notes).
    """
    # zero3/hsdp: a copy of the user's module on the full parameters, differentiable into
    # the shards; other strategies: the user's module itself.
    inner = module.plain_module() if isinstance(module, DistributedModule) else module
    memo: dict[int, Any] = {
        id(original): new
        for _, original, new in _converted(inner, by, detach_buffers, with_buffers=True)
    }
    return copy.deepcopy(inner, memo)  # type: ignore[return-value]


def extract_state_dict(target: nn.Module | Any, *, by: By = "reference",
                       with_buffers: bool = True, detach_buffers: bool = False) -> Any:
    """A snapshot to hand back to :func:`recover_state_dict` later.

    For a module (or a strategy's wrapped model: the user's module's names):
    ``{qualified name: tensor}`` for every parameter (tied aliases included,
    mapped to one shared tensor) and, with ``with_buffers``, every buffer, taken over ``by``
    as in :func:`module_clone`. For a :class:`~metadist.meta.MetaOptimizer`: its state
    (tensors taken over likewise; ``"deepcopy"`` detaches them).
    """
    from metadist.meta.optim import MetaOptimizer

    if isinstance(target, MetaOptimizer):
        _check_by(by)
        if by == "reference":
            return target.state
        take: Callable[[Tensor], Tensor] = (
            (lambda t: t.clone()) if by == "copy" else (lambda t: t.detach().clone()))
        return torch.utils._pytree.tree_map_only(Tensor, take, target.state)
    if not isinstance(target, nn.Module):
        raise TypeError(f"extract_state_dict takes an nn.Module or a MetaOptimizer, got "
                        f"{type(target).__name__}")
    inner = unwrap(target)
    return {name: new for name, _, new in _converted(inner, by, detach_buffers, with_buffers)}


def recover_state_dict(target: nn.Module | Any, state: Any) -> None:
    """Put a snapshot from :func:`extract_state_dict` back, e.g. restore a module's original
    parameters after an inner loop before the next task. Tensors are rebound, not copied:
    the module holds the snapshot's tensors afterwards (originals for ``by="reference"``).
    Names the snapshot lacks are left as they are."""
    from metadist.meta.optim import MetaOptimizer

    if isinstance(target, MetaOptimizer):
        target.load_state_dict({"state": state})
        return
    if not isinstance(target, nn.Module):
        raise TypeError(f"recover_state_dict takes an nn.Module or a MetaOptimizer, got "
                        f"{type(target).__name__}")
    if not isinstance(state, Mapping):
        raise TypeError("recover_state_dict(module, state) needs the name -> tensor mapping "
                        f"from extract_state_dict(module), got {type(state).__name__}")
    inner = unwrap(target)
    known = {name for kind in ("_parameters", "_buffers") for name, *_ in iter_slots(inner, kind)}
    unknown = sorted(set(state) - known)
    if unknown:  # before anything changes
        raise KeyError(f"the snapshot names {', '.join(unknown[:5])}"
                       f"{' ...' if len(unknown) > 5 else ''}, which the module does not have; "
                       "recover into the module the snapshot was extracted from")
    rebind_parameters(inner, state)


def functional_call(module: nn.Module, params: Mapping[str, Tensor] | Sequence[Tensor],
                    args: Any = (), kwargs: dict[str, Any] | None = None) -> Any:
    """Run ``module`` with ``params`` in place of its parameters (its own are untouched).

    ``params`` is a name -> tensor mapping (buffers may be included; names not given keep
    their current tensors; one name of a tied pair sets both; a name the module does not
    have raises), or a sequence matching ``module.named_parameters()`` order (what
    ``tuple(module.parameters())`` gives). ``args`` is a tuple of positional arguments or a
    single one, as for ``torch.func.functional_call``; it runs under
    :func:`~metadist.strategies.bind.bind_parameters`.
    """
    if isinstance(params, Mapping):
        named = dict(params)
    else:
        names = [n for n, _ in module.named_parameters()]
        values = list(params)
        if len(values) != len(names):
            raise ValueError(f"got {len(values)} tensors for a module with {len(names)} "
                             f"parameters ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                             "); pass one per named_parameters() entry, or a name -> tensor dict")
        named = dict(zip(names, values, strict=True))
    with bind_parameters(module, named):
        return module(*(args if isinstance(args, tuple) else (args,)), **(kwargs or {}))
