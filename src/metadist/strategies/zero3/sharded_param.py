"""zero3/hsdp: the user's parameter as ``model.parameters()`` yields it.

[Note: one parameter, this rank's slice]
The values of a unit's parameters live in flat shards (flat.py): rank r holds elements
``[r*S, (r+1)*S)`` of the unit's concatenated parameters. Between its unit's forwards a
parameter is a :class:`ShardedParam` in its module's registry: it carries the user's name,
global shape, dtype, device and ``requires_grad`` (as FSDP2's DTensor parameters do), and
*where* its values are, ``(flat, slot index)``. What a program computes from it runs on
this rank's slice of it (:func:`piece`: the part of the parameter inside this rank's shard,
a view, possibly empty) under the shard-value policy (strategies/tensors/shard_value.py):

* element-wise arithmetic (an optimizer's update, ``p.data.clamp_``, ``p.grad.mul_``) is
  one process's on those elements, in place in the shard;
* a whole reduction that needs no gradient (``p.grad.norm()``, ``p.abs().max()``) is over
  the whole parameter, every rank's slice (one all-reduce: whole_reductions.py);
* anything that combines elements otherwise (a matmul, a reshape) stops, naming the
  parameter and what to read instead (``model.full_parameters()``).

As for a DTensor, ``p.to_local()`` is this rank's slice and ``p.full_tensor()`` the whole
parameter (collective, differentiable into the shard).

``p.grad`` is this rank's slice of the parameter's reduced gradient (None: no backward
reduced into its unit since the gradient was last set to None); ``p.grad = None`` clears
that parameter's gradient alone. ``p.requires_grad_`` is the user's flag: a flat's shard
follows its parameters' flags once they agree (strategy.py checks the rest before a
forward).

While a computation binds other values to the parameter (fast weights: ``RESOLVERS``),
every path reads those instead; a known meta-learning library copying the model, or a
conversion (``p.to``), stops as before: strategies/zero3/foreign_runs.py.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from metadist.strategies.tensors import shard_value
from metadist.strategies.tensors.policy import (
    CONVERSIONS,
    DESCRIBES,
    WHOLE_VALUES,
    function_name,
)
from metadist.strategies.tensors.shard_value import ShardValue
from metadist.strategies.tensors.whole_reductions import Span
from metadist.strategies.zero3.foreign_runs import LIBRARIES, library_on_stack, per_rank_copy

#: Given a parameter's source, the values a computation running now binds to it (None:
#: nothing binds it). zero3/hsdp fast weights register theirs (strategies/zero3/
#: sharded_fast.py): within a problem's computation on fast weights every path reads them.
RESOLVERS: list[Callable[[Any], torch.Tensor | None]] = []


def resolved(source: Any) -> torch.Tensor | None:
    """The values a computation running now binds to the parameter at ``source`` (a
    (flat, slot index)), or None."""
    if source is None:
        return None
    return next((v for r in RESOLVERS if (v := r(source)) is not None), None)


_FLAG = frozenset({"requires_grad_", "requires_grad="})


class ShardedParam(torch.Tensor):
    """A zero3/hsdp parameter between its unit's forwards (module notes): the user's name
    and global shape; computations run on this rank's slice of it."""

    fqn: str
    source: Any  # (flat, slot index): where the values are

    @staticmethod
    def __new__(cls, fqn: str, shape: torch.Size, dtype: torch.dtype,
                source: Any = None, requires_grad: bool = False) -> ShardedParam:
        out = torch.Tensor._make_subclass(
            cls, torch.empty(shape, dtype=dtype, device="meta"), requires_grad)
        out.fqn, out.source = fqn, source
        out._is_param = True  # isinstance(p, nn.Parameter) holds, as for FSDP2's
        return out

    def to_local(self) -> torch.Tensor:
        """This rank's slice of the parameter (a view of its flat's shard, possibly empty),
        as DTensor's ``to_local`` gives a rank's part."""
        start, stop = _range(*self.source)
        with torch._C.DisableTorchFunctionSubclass():
            local: torch.Tensor = self.source[0].shard.as_subclass(torch.Tensor)[start:stop]
        return local

    def full_tensor(self) -> torch.Tensor:
        """Collective (every rank calls it for the same parameters, in the same order, as
        DTensor's ``full_tensor``): the whole parameter, differentiable into its flat's
        shard where that is trained; the values a running computation binds, if any."""
        bound = resolved(self.source)
        if bound is not None:
            return bound
        flat, index = self.source
        whole: torch.Tensor = flat.owned_views()[index]
        return whole

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = function_name(func, setters=True)
        first = args[0] if args and isinstance(args[0], ShardedParam) else None
        if name in DESCRIBES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.autograd.grad:
            return _autograd_grad(args, kwargs)
        if first is not None and first.source is not None:
            if name == "device":
                return first.source[0].device
            if name in _FLAG:
                return _set_flag(first, func, args, kwargs)
            if name == "grad":
                return grad_of(first)
            if name == "grad=":
                set_grad(first, args[1])
                return None
        bound = _replace(args, kwargs, resolved)
        if bound is not None:  # the values the running computation binds
            with torch._C.DisableTorchFunctionSubclass():
                return func(*bound[0], **bound[1])
        held = next((a for a in tree_flatten((args, kwargs))[0]
                     if isinstance(a, ShardedParam)), None)
        fqn = held.fqn if held is not None else "a parameter"
        library = library_on_stack()
        if library is not None:
            raise RuntimeError(per_rank_copy(
                f"{LIBRARIES[library]} read {fqn!r} ({name}) to copy the model, which "
                "runs as it is under ddp, zero1 and zero2"))
        if name in CONVERSIONS:
            raise RuntimeError(
                f"{fqn!r} of the set-up model holds this rank's slice of its values under "
                f"zero3/fsdp/hsdp, not values to move or convert ({name} read it). Move or "
                "convert the model strategy.setup returned (model.to(...), model.float()), "
                "which moves its shards and buffers")
        sliced = _replace(args, kwargs, lambda source: piece(*source))
        if sliced is None or name in WHOLE_VALUES:
            raise RuntimeError(_no_values(fqn, name))
        try:
            return func(*sliced[0], **sliced[1])  # the shard-value policy decides
        except ValueError as e:
            if "across the elements of a zero3/hsdp shard" not in str(e):
                raise
            raise RuntimeError(_no_values(fqn, name)) from e


shard_value.DEFERS_TO = (ShardedParam,)


def _autograd_grad(args: Any, kwargs: Any) -> Any:
    """``torch.autograd.grad`` with respect to parameters: with respect to their flats'
    shards (which refuse it outside ``model.reduced_shard_grads()``: shard_grads.py), each
    parameter's result its slice of its shard's."""
    bound = inspect.signature(torch.autograd.grad).bind(*args, **kwargs)
    inputs = bound.arguments["inputs"]
    single = isinstance(inputs, torch.Tensor)
    listed = [inputs] if single else list(inputs)
    shards: dict[int, torch.Tensor] = {}
    for t in listed:
        target = t.source[0].shard if isinstance(t, ShardedParam) else t
        shards.setdefault(id(target), target)
    bound.arguments["inputs"] = list(shards.values())
    with torch._C.DisableTorchFunctionSubclass():
        grads = dict(zip(shards, torch.autograd.grad(*bound.args, **bound.kwargs),
                         strict=True))
    out = []
    for t in listed:
        if not isinstance(t, ShardedParam):
            out.append(grads[id(t)])
            continue
        flat, index = t.source
        whole = grads[id(flat.shard)]
        start, stop = _range(flat, index)
        out.append(None if whole is None else whole[start:stop])  # asked for: this slice
    return tuple(out)


def _no_values(fqn: str, name: str) -> str:
    return (
        f"{name} of {fqn!r} reads or combines all of the parameter's elements, and under "
        "zero3/fsdp/hsdp this rank holds only a slice of it (the whole parameter exists "
        "only while the module holding it runs its forward). Compute with it inside that "
        "forward, or read the parameter's full_tensor() or "
        f"model.full_parameters()[{fqn!r}] (collective, differentiable into the shards); "
        "element-wise arithmetic (p.mul_(c), p.grad.clamp_(-c, c)) and whole reductions "
        "(p.grad.norm(), p.abs().max()) run as they are")


def _replace(args: Any, kwargs: Any, value_of: Callable[[Any], torch.Tensor | None]
             ) -> tuple[Any, Any] | None:
    """``(args, kwargs)`` with every parameter replaced by ``value_of(its source)``; None
    where one has none."""
    leaves, spec = tree_flatten((args, kwargs))
    out = []
    for leaf in leaves:
        if not isinstance(leaf, ShardedParam):
            out.append(leaf)
            continue
        value = value_of(leaf.source) if leaf.source is not None else None
        if value is None:
            return None
        out.append(value)
    result: tuple[Any, Any] = tree_unflatten(out, spec)
    return result


def _range(flat: Any, index: int) -> tuple[int, int]:
    """The slot's elements inside this rank's shard, in shard coordinates."""
    slot = flat.slots[index]
    lo = flat.rank * flat.shard_size
    start = min(max(slot.offset - lo, 0), flat.shard_size)
    stop = min(max(slot.offset + slot.numel - lo, 0), flat.shard_size)
    return start, max(start, stop)


def _assemble(flat: Any, index: int, local: torch.Tensor) -> torch.Tensor:
    """Collective: the whole parameter-shaped tensor whose slice on each rank is ``local``
    (the parameter's gradient, a value computed from its slice)."""
    start, stop = _range(flat, index)
    if local.numel() != stop - start:
        raise ValueError(
            f"full_tensor() of a tensor of {local.numel()} elements, whose place in "
            f"{flat.slots[index].fqn!r} is this rank's slice of {stop - start}: only values of "
            "the slice's shape (the gradient, values computed from it element by element) "
            "have one")
    laid_out = torch.zeros(flat.shard_size, dtype=local.dtype, device=flat.device)
    laid_out[start:stop] = local.reshape(-1)
    slot = flat.slots[index]
    whole: torch.Tensor = flat.gather_laid_out(laid_out)
    return whole[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()


def _spanned(t: torch.Tensor, flat: Any, index: int) -> ShardValue:
    out = t.as_subclass(ShardValue) if not isinstance(t, ShardValue) else t
    out._metadist_span = Span(flat.group, t.numel(),  # type: ignore[attr-defined]
                              flat.slots[index].numel,
                              assemble=functools.partial(_assemble, flat, index))
    return out


def piece(flat: Any, index: int) -> ShardValue:
    """This rank's slice of the parameter at ``(flat, index)``: a view of the shard."""
    start, stop = _range(flat, index)
    with torch._C.DisableTorchFunctionSubclass():
        view = flat.shard.as_subclass(torch.Tensor)[start:stop]
    return _spanned(view, flat, index)


def slice_of(t: torch.Tensor, param: ShardedParam) -> ShardValue:
    """The parameter's slice of ``t``, a tensor laid out as its flat's shard (its gradient,
    its optimizer state)."""
    flat, index = param.source
    start, stop = _range(flat, index)
    with torch._C.DisableTorchFunctionSubclass():
        view = t.as_subclass(torch.Tensor)[start:stop]
    return _spanned(view, flat, index)


def grad_of(param: ShardedParam) -> ShardValue | None:
    """This rank's slice of the parameter's gradient (the same object until it changes)."""
    flat, index = param.source
    grad = flat.shard.grad
    if grad is None or index in flat.cleared:
        return None
    cached = param.__dict__.get("_grad_piece")
    if cached is not None and cached[0] is grad:
        value: ShardValue = cached[1]
        return value
    value = slice_of(grad, param)
    param.__dict__["_grad_piece"] = (grad, value)
    return value


def set_grad(param: ShardedParam, value: torch.Tensor | None) -> None:
    """``p.grad = value``: None clears this parameter's gradient alone (the shard's goes
    once all its parameters' have); a tensor of the parameter's shape (or of this rank's
    slice) is written into this rank's slice."""
    flat, index = param.source
    grad = flat.shard.grad
    start, stop = _range(flat, index)
    if value is None:
        if grad is None:
            return
        with torch.no_grad():
            grad.as_subclass(torch.Tensor)[start:stop].zero_()  # a later backward adds to 0
        flat.cleared.add(index)
        if flat.reached is not None:
            flat.reached[index] = False
        if len(flat.cleared) == len(flat.slots):
            flat.shard.grad = None
            flat.cleared.clear()
        return
    with torch._C.DisableTorchFunctionSubclass():
        local = value.detach().as_subclass(torch.Tensor)
    if local.shape == param.shape:  # this rank's elements of it
        first = flat.rank * flat.shard_size + start - flat.slots[index].offset
        local = local.reshape(-1)[first:first + stop - start]
    elif local.numel() != stop - start:
        raise ValueError(
            f"p.grad = <tensor of shape {tuple(value.shape)}> for {param.fqn!r} of shape "
            f"{tuple(param.shape)}: give a tensor of the parameter's shape")
    with torch.no_grad():
        if grad is None:
            flat.shard.grad = torch.zeros_like(flat.shard.as_subclass(torch.Tensor))
            flat.cleared.update(i for i in range(len(flat.slots)) if i != index)
            grad = flat.shard.grad
        grad.as_subclass(torch.Tensor)[start:stop].copy_(local.reshape(-1))
    flat.cleared.discard(index)


def _set_flag(param: ShardedParam, func: Any, args: Any, kwargs: Any) -> Any:
    """``requires_grad_`` / ``requires_grad =`` on the parameter itself; its flat's shard
    follows once all the flat's parameters agree."""
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    flat = param.source[0]
    flat.shard.requires_grad_(any(p.requires_grad for p in flat.placeholders))
    return param if out is None else out


def check_flags(flats: list[Any], at_setup: list[bool]) -> None:
    """Before a forward: each flat's shard requires a gradient while any of its parameters
    does; a flat frozen at setup stays frozen.

    Freezing parameters after setup is one process's freeze, also a part of a flat: the
    frozen ones get no gradient (:meth:`FlatParam.views`) and the step skips them
    (strategies/zero3/unreached.py). zero3 keeps parameters frozen at setup in flats of
    their own, without gradient or optimizer state: those cannot start training later."""
    unfrozen = [p.fqn for flat, then in zip(flats, at_setup, strict=True) if not then
                for p in flat.placeholders if p.requires_grad]
    if unfrozen:
        raise ValueError(
            f"requires_grad was set after setup on {unfrozen[:4]}"
            f"{' ...' if len(unfrozen) > 4 else ''}, which were frozen at setup: zero3/fsdp/"
            "hsdp keeps parameters frozen at setup in shards without gradients or optimizer "
            "state. Set up the model with them trainable and freeze them after setup until "
            "they should train (freezing after setup is exact), or use ddp, zero1 or zero2")
    for flat in flats:
        flag = any(p.requires_grad for p in flat.placeholders)
        if flat.shard.requires_grad != flag:
            flat.shard.requires_grad_(flag)


def user_parameters(flats: Sequence[Any], modules: Sequence[tuple[str, nn.Module]],
                    remove_duplicate: bool) -> Iterator[tuple[str, nn.Parameter]]:
    """``modules``' registry entries by name, each sharded one as its :class:`ShardedParam`
    also while its unit holds gathered views there (the root unit from a forward to the
    step)."""
    held = {(id(module), attr): placeholder for flat in flats
            for slot, placeholder in zip(flat.slots, flat.placeholders, strict=True)
            for module, attr in slot.uses}
    seen: set[int] = set()
    for path, module in modules:
        for attr, entry in module._parameters.items():
            value: Any = held.get((id(module), attr), entry)
            if value is None or (remove_duplicate and id(value) in seen):
                continue
            seen.add(id(value))
            yield (f"{path}.{attr}" if path else attr), value


@contextmanager
def set_aside(flats: Sequence[Any]) -> Iterator[None]:
    """The parameters out of their modules' registries for the block (``model.to(...)``
    converts the shards, not them), put back in their places after it (registration order
    kept)."""
    registries: dict[int, tuple[dict[str, Any], list[str], dict[str, Any]]] = {}
    for flat in flats:
        for slot, placeholder in zip(flat.slots, flat.placeholders, strict=True):
            for module, attr in slot.uses:
                registry: dict[str, Any] = module._parameters
                if registry.get(attr) is placeholder:
                    entry = registries.setdefault(id(registry), (registry, list(registry), {}))
                    entry[2][attr] = registry.pop(attr)
    try:
        yield
    finally:
        for registry, order, aside in registries.values():
            current = dict(registry)
            registry.clear()  # the same dict: bindings hold it as their place
            registry.update({k: aside[k] if k in aside else current[k] for k in order
                             if k in aside or k in current})
            registry.update({k: v for k, v in current.items() if k not in order})
