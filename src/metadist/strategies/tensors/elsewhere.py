"""zero2: the gradient of a parameter another rank owns, held as a placeholder that says so.

Under zero2 a rank keeps only the gradients of the parameters it owns. Leaving ``None`` on the
others made a program's loop over ``p.grad`` (a norm written by hand, a largest gradient, a
log line guarded by ``if p.grad is not None``) add up this rank's part, silently. So each of
the others holds an :class:`ElsewhereGrad`: the gradient's shape, dtype and device, no values.

* An in-place change of it (``p.grad.mul_(c)``, ``clamp_``, ``add_(p, alpha=wd)``, clipping by
  a coefficient) does nothing here: the owner runs the same line on the gradient it holds,
  the one its step uses.
* Anything computed from it is again a placeholder (``p.grad.norm()``, a sum over parameters
  that includes one), so a wrong partial value never exists.
* What it is reads as for any tensor (shape, dtype, ``is_pinned()``), and the storage of
  this rank's part is empty (``untyped_storage().nbytes()`` is 0: a memory measure counts
  what this rank holds).
* Reading values out of one (``.item()``, ``float()``, ``if``, ``.tolist()``, ``.numpy()``)
  or writing them into a tensor that holds values (``p.data.add_(p.grad)``,
  ``coef = max_norm / total`` used on an owned gradient) raises, naming the parameter, its
  owner and what to write instead.

Autograd never accumulates into a placeholder: a hook on each such parameter drops it before
a backward accumulates there (strategies/buckets.py), and metadist's own code reads
:func:`held_grad`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from metadist.runtime.world import Group
from metadist.strategies.tensors.policy import (
    METADATA,
    PLAIN,
    READS,
    STORAGES,
    VALUE_READS,
    WHOLE,
    function_name,
)
from metadist.strategies.tensors.whole_reductions import (
    Span,
    full_of,
    local_caller,
    read_whole,
    reduce_whole,
)

ADVICE = (
    "Use torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or "
    "strategy.clip_grad_norm_(model, max_norm) for the gradient norm (both global, a "
    "collective); change gradients in place (p.grad.mul_(c), p.grad.clamp_(-c, c)), which is "
    "exact: each owner makes the change; step parameters through the optimizer; or use "
    "strategy 'zero1', which keeps every gradient on every rank")


class ElsewhereGrad(Tensor):
    """A gradient that zero2 keeps on another rank, or a value computed from one (module
    notes)."""

    owner: int
    param_name: str
    group: Group
    _metadist_span: Span | None

    @staticmethod
    def __new__(cls, shape: Any, dtype: torch.dtype, device: torch.device, owner: int,
                name: str, group: Group = None, whole: bool = True) -> ElsewhereGrad:
        t = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t.owner, t.param_name, t.group = owner, name, group
        # a whole reduction of the gradient (or of a value of its shape computed from it) is
        # its owner's, over the group (whole_reductions.py)
        t._metadist_span = Span(group, 0, math.prod(shape), owner) if whole else None
        return t

    @staticmethod
    def like(p: Tensor, owner: int, name: str, group: Group = None) -> ElsewhereGrad:
        return ElsewhereGrad(p.shape, p.dtype, p.device, owner, name, group)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"ElsewhereGrad(shape={tuple(self.shape)}, dtype={self.dtype}, of the gradient "
                f"of {self.param_name!r}: kept by rank {self.owner})")

    def full_tensor(self) -> Tensor:
        """Collective over the group, as DTensor's: the owner's gradient."""
        return full_of(self)

    def __format__(self, spec: str) -> str:
        if spec:  # a number's format: its owner's value, or a refusal
            done, value = read_whole("__format__", (self, spec), {})
            if done:
                return str(value)
            raise ValueError(_message(self, f"format(..., {spec!r}) reads"))
        return repr(self)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = function_name(func)
        if name in WHOLE or name in READS:
            local = local_caller()
            if (not local and name in WHOLE
                    and (whole := reduce_whole(name, args, kwargs or {})) is not None):
                return whole  # the owner's value, over the group
            if not local and name in READS:
                done, value = read_whole(name, args, kwargs or {})
                if done:
                    return value
        if name in STORAGES:
            empty = torch.UntypedStorage(0, device=_first(args, kwargs).device)
            if name == "untyped_storage":
                return empty
            return torch.TypedStorage(wrap_storage=empty, dtype=_first(args, kwargs).dtype,
                                      _internal=True)
        if name in VALUE_READS:
            raise ValueError(_message(_first(args, kwargs), f"{name.strip('_')}() reads"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        first = _first(args, kwargs)
        if op.startswith("_foreach_"):
            return _foreach(func, args, kwargs)
        written = _written(func, args, kwargs)
        if written:
            if all(isinstance(w, ElsewhereGrad) for w in written):
                return args[0] if args else None  # the owner makes the same change
            raise ValueError(_message(first, f"{op} would write", into=True))
        out = func(*_on_meta(args), **_on_meta(kwargs))
        values = tree_flatten(out)[0]
        if op not in METADATA and any(not isinstance(v, Tensor) for v in values):
            raise ValueError(_message(first, f"{op} reads"))
        device = kwargs.get("device") or first.device  # a copy elsewhere moves it
        return tree_map(lambda t: _placeholder(t, first, device) if isinstance(t, Tensor)
                        else t, out)


def held_grad(p: Tensor) -> Tensor | None:
    """``p``'s gradient where this rank holds it (plain); None for none or a placeholder
    (zero2: another rank owns ``p``)."""
    g = p.grad
    if g is None or isinstance(g, ElsewhereGrad):
        return None
    return g.as_subclass(Tensor) if isinstance(g, OwnedGrad) else g


def _first(args: Any, kwargs: Any) -> ElsewhereGrad:
    found = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, ElsewhereGrad)]
    return found[0]


def _message(origin: ElsewhereGrad, what: str, into: bool = False) -> str:
    where = " into a tensor that holds values on this rank" if into else ""
    return (f"{what} the values of the gradient of {origin.param_name!r} (or of a value "
            f"computed from it){where}, but zero2 keeps that gradient only on rank "
            f"{origin.owner}, the parameter's owner: each rank holds the gradients of the "
            "parameters it owns, so a sum over p.grad would be this rank's part of one "
            f"process's. {ADVICE}")


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The tensors ``func`` writes into (its mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out += [v for v in tree_flatten(value)[0] if isinstance(v, Tensor)]
    return out


def _on_meta(tree: Any) -> Any:
    """Every tensor of ``tree`` as an empty tensor of its shape on the meta device: what an
    operator would return is worked out without values."""
    return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                  device="meta")
                    if isinstance(t, Tensor) else t, tree)


def _placeholder(t: Tensor, origin: ElsewhereGrad, device: Any = None) -> ElsewhereGrad:
    # of another shape (an index, a reduction along a dimension) the owner's value is plain,
    # so a whole reduction of it is collective on neither side
    return ElsewhereGrad(t.shape, t.dtype, device or origin.device, origin.owner,
                         origin.param_name, origin.group,
                         whole=origin._metadist_span is not None and t.shape == origin.shape)


class OwnedGrad(Tensor):
    """zero2: the gradient of a parameter this rank owns, and what a program computes from
    it element by element: a plain tensor whose whole reductions (module notes) are over
    the group, as the placeholders on the other ranks' are, so both sides' all-reduces
    pair."""

    owner: int
    param_name: str
    _metadist_span: Span

    @staticmethod
    def of(view: Tensor, owner: int, name: str, group: Group) -> OwnedGrad:
        out = view.as_subclass(OwnedGrad)
        out.owner, out.param_name = owner, name
        out._metadist_span = Span(group, view.numel(), view.numel(), owner)
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = function_name(func)
        local = local_caller()
        if not local and name in WHOLE and (whole := reduce_whole(name, args, kwargs)) is not None:
            return whole
        if not local and name in READS:
            done, value = read_whole(name, args, kwargs)
            if done:  # joins the broadcast its placeholders wait in
                return value
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if local or name in _PLAIN_RESULTS:
            return out
        source = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, OwnedGrad))
        inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        return tree_map(lambda t: OwnedGrad.of(t, source.owner, source.param_name,
                                               source._metadist_span.group)
                        if isinstance(t, Tensor) and id(t) not in inputs
                        and t.shape == source.shape else t, out)

    def full_tensor(self) -> Tensor:
        """Collective over the group, as DTensor's: this gradient on every rank."""
        return full_of(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved as a plain tensor: a file loads without metadist."""
        with torch._C.DisableTorchFunctionSubclass():
            return Tensor.__reduce_ex__(self.as_subclass(Tensor), protocol)


#: calls whose results are not values computed from the gradient
_PLAIN_RESULTS = PLAIN | {"__reduce_ex__", "as_subclass", "detach"}


def _foreach(func: Any, args: Any, kwargs: Any) -> Any:
    """A multi-tensor kernel position by position: on the real tensors as one call; where a
    placeholder is involved, as the single-tensor rules above (a change of one does nothing,
    what is computed from one is one, a real tensor written from one raises)."""
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    n = len(args[0])
    in_place = func._schema.name.endswith("_")
    touched = [any(isinstance(args[i][k], ElsewhereGrad) for i in lists)
               or any(isinstance(v, ElsewhereGrad) for j, v in enumerate(args)
                      if j not in lists) for k in range(n)]
    for k in range(n):
        if in_place and touched[k] and not isinstance(args[0][k], ElsewhereGrad):
            raise ValueError(_message(_first(args, kwargs),
                                      f"{func.overloadpacket.__name__} would write", into=True))
    real = [k for k in range(n) if not touched[k]]
    picked = [[a[k] for k in real] if i in lists else a for i, a in enumerate(args)]
    out = func(*picked, **kwargs) if real else ([] if not in_place else None)
    if in_place:
        return None
    origin = _first(args, kwargs) if any(touched) else None
    results: list[Any] = []
    computed = iter(out or [])
    for k in range(n):
        if touched[k]:
            assert origin is not None
            row = [a[k] if i in lists else a for i, a in enumerate(args)]
            shape = func(*_on_meta(_single(row, lists)), **_on_meta(kwargs))[0]
            results.append(_placeholder(shape, origin))
        else:
            results.append(next(computed))
    return results


def _single(row: list[Any], lists: list[int]) -> list[Any]:
    """One position of a multi-tensor call, as a call on one-element lists."""
    return [[a] if i in lists else a for i, a in enumerate(row)]
