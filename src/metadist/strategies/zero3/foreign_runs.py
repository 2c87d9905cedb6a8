"""zero3/hsdp: a set-up model run on tensors other than its own, by a path metadist cannot see.

Under zero3/hsdp the model's parameters are this rank's flat shards, and every forward
gathers all ranks' shards. A per-rank copy of the parameters (the fast weights of an inner
loop) therefore cannot be run by the paths that work under ddp: a clone whose parameters were
cloned into the graph (learn2learn's ``MAML.clone()``), a patched copy of the module class
(higher's ``innerloop_ctx``), ``torch.func.functional_call`` with the shards swapped, a deep
copy. Each is recognised where it first runs (the model's forward) and refused before any
value is computed, naming the path taken, the library on the stack, and the portable form.

Between its units' forwards the user's module holds no parameter values at all: each
parameter's registry entry (what its attribute, ``_parameters``, ``parameters()`` and
``state_dict()`` read) holds a :class:`Placeholder` (shape, dtype, ``requires_grad``; no
data), and any computation on one, or a read of its ``.grad`` (a method of the module
reading ``self.lin.weight`` outside the forward, a hand-written loop over its gradients)
stops with an error naming the parameter and what to read instead; where a known library
read it, the error names the library and the portable form.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

#: libraries whose meta-learning idioms reach a model by such paths, and by which calls
_LIBRARIES = {
    "learn2learn": "learn2learn's MAML.clone() / clone_module",
    "higher": "higher's innerloop_ctx / monkeypatch",
    "torchopt": "TorchOpt's module tools",
}


class Origin:
    """What a set-up model is at setup, to tell it later from a copy or a patched class."""

    def __init__(self, model: nn.Module) -> None:
        self.id, self.type = id(model), type(model)


def refuse_foreign_run(model: nn.Module, origin: Origin, swapped: list[str]) -> None:
    """Raise if ``model`` (about to run its forward) is not the set-up model itself on its
    own shards: ``swapped`` names the shards replaced by other tensors."""
    if id(model) == origin.id and type(model) is origin.type and not swapped:
        return
    library = _library_on_stack()
    if type(model) is not origin.type:
        how, by = "a patched subclass of the set-up model", type(model).__module__
    elif id(model) != origin.id:
        shards: Any = model.shards
        cloned = any(p.grad_fn is not None for p in shards.parameters())
        how = ("a copy of the set-up model whose parameters were cloned into the graph"
               if cloned else "a copy of the set-up model")
        by = "copy.copy or copy.deepcopy"
    else:
        names = ", ".join("shards." + n for n in swapped[:3]) + (" ..." * (len(swapped) > 3))
        how = f"the set-up model with its parameters ({names}) replaced by other tensors"
        by = "torch.func.functional_call"
    if library is not None:
        by = f"{_LIBRARIES[library]} (which runs as it is under ddp, zero1 and zero2)"
    raise RuntimeError(_per_rank_copy(f"this forward runs {how}, made by {by}"))


def library_walking() -> bool:
    """Whether a known meta-learning library's code is running (only looked for once one
    is imported): it walks the model's registry itself, so the set-up model lists what that
    walk finds, and the library's first computation on a placeholder names it."""
    return any(name in sys.modules for name in _LIBRARIES) and _library_on_stack() is not None


def _per_rank_copy(what: str) -> str:
    return (
        f"zero3/fsdp/hsdp: {what}. Here the model's "
        "parameters are this rank's flat shards and every forward gathers all ranks' "
        "shards, so a per-rank copy of them (an inner loop's fast weights) cannot be run "
        "this way. Write the inner loop in the portable form, the same under every "
        "strategy: fast = model.full_parameters(); loss = loss_fn(model.functional_forward("
        "fast, x), y); grads = torch.autograd.grad(loss, list(fast.values()), "
        "create_graph=True); fast = {n: p - lr * g for (n, p), g in zip(fast.items(), "
        "grads)}. Or clone with metadist.meta.module_clone(model, by='copy') and step the "
        "clone with metadist.meta.MetaSGD(clone, lr). torch.func.functional_call works "
        "with full parameters under the model's names: {'module.' + n: p for n, p in "
        "fast.items()}")


def refuse_deepcopy(model: nn.Module) -> None:
    raise TypeError(
        f"copy.deepcopy of a zero3/fsdp/hsdp model ({type(model).__name__}) would copy this "
        "rank's flat shards and the strategy's machinery, not your module: for a plain "
        "copy of your module with its full parameters use "
        "metadist.meta.module_clone(model, by='deepcopy') (collective), or save and load "
        "model.state_dict() (collective) into a new instance of your module")


def _library_on_stack() -> str | None:
    """The first known library among the callers (its top-level package name)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        top = str(frame.f_globals.get("__name__", "")).split(".", 1)[0]
        if top in _LIBRARIES:
            return top
        frame = frame.f_back
    return None


#: Given a placeholder, the values a computation running now binds to it (None: nothing
#: binds it). zero3/hsdp fast weights register theirs (strategies/zero3/sharded_fast.py): within
#: a problem's computation on fast weights every path reads them, not only the units'
#: forwards.
RESOLVERS: list[Callable[[Any], torch.Tensor | None]] = []


def resolved(source: Any) -> torch.Tensor | None:
    """The values a computation running now binds to the parameter at ``source`` (a
    placeholder's (flat, slot index)), or None."""
    if source is None:
        return None
    return next((v for r in RESOLVERS if (v := r(source)) is not None), None)


def _resolve(tree: Any) -> Any:
    """``tree`` with every placeholder replaced by its resolved values; None if one has
    none."""
    leaves, spec = tree_flatten(tree)
    out = []
    for leaf in leaves:
        value = resolved(leaf.source) if isinstance(leaf, Placeholder) else leaf
        if value is None:
            return None
        out.append(value)
    return tree_unflatten(out, spec)


#: what a placeholder answers without data (its description), by function or property name
_DESCRIBES = frozenset({
    "shape", "dtype", "device", "is_meta", "size", "dim", "ndim", "numel", "requires_grad",
    "is_leaf", "grad_fn", "layout", "is_floating_point", "is_complex", "element_size",
    "_version", "__repr__", "__format__", "__hash__", "__eq__", "__len__", "is_cuda",
    "is_sparse", "itemsize", "nbytes", "names", "_is_view", "untyped_storage"})


#: what nn.Module._apply calls (module.to/cpu/cuda/float/...): answered with the set-up model
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type",
                          "share_memory_"})


class Placeholder(torch.Tensor):
    """A zero3/hsdp parameter between forwards, in its module's registry and attribute: a
    meta tensor that describes the parameter (``parameters()`` lists it, a count of
    parameters is one process's), and refuses any computation, and its ``.grad``, with an
    error that names it. ``detach()`` gives itself: a state dict holds it in its place until
    the strategy's hook writes the values there (strategies/state_dict.py)."""

    fqn: str
    source: Any  # (flat, slot index): where the values are, for a resolver

    @staticmethod
    def __new__(cls, fqn: str, shape: torch.Size, dtype: torch.dtype,
                source: Any = None, requires_grad: bool = False) -> Placeholder:
        out = torch.Tensor._make_subclass(
            cls, torch.empty(shape, dtype=dtype, device="meta"), requires_grad)
        out.fqn, out.source = fqn, source
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in ("__get__", "__set__"):  # a property: by the property's name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _DESCRIBES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if name == "detach" and isinstance(args[0], Placeholder):
            return args[0]
        resolved = _resolve((args, kwargs or {}))
        if resolved is not None:  # the values the running computation binds
            with torch._C.DisableTorchFunctionSubclass():
                return func(*resolved[0], **resolved[1])
        held = next((a for a in args if isinstance(a, Placeholder)), None)
        fqn = held.fqn if held is not None else "a parameter"
        library = _library_on_stack()
        if library is not None:
            raise RuntimeError(_per_rank_copy(
                f"{_LIBRARIES[library]} read {fqn!r} ({name}) to copy the model, which "
                "runs as it is under ddp, zero1 and zero2"))
        if name in _CONVERSIONS:
            raise RuntimeError(
                f"{fqn!r} of the set-up model holds no values to move or convert ({name} read "
                "it): under zero3/fsdp/hsdp the values are the flat shards. Move or convert the "
                "model strategy.setup returned (model.to(...), model.float()), which moves its "
                "shards and buffers and leaves your module's placeholders in place")
        if name == "grad":
            raise RuntimeError(
                f"{fqn!r} of the set-up model has no .grad: under zero3/fsdp/hsdp its gradient "
                "is a slice of the flat shards' gradients, which model.parameters() yields. "
                "Read gradients from model.parameters() (clip them with "
                "strategy.clip_grad_norm_(model, max_norm)) and zero them with "
                "optimizer.zero_grad() or model.zero_grad(), model being the set-up model")
        raise RuntimeError(
            f"{fqn!r} of the set-up model has no values here ({name} read it): under "
            "zero3/fsdp/hsdp parameters are sharded across ranks and gathered only while "
            "the module holding them runs its forward. Compute with it inside that "
            f"forward, or read model.full_parameters()[{fqn!r}] (collective, "
            "differentiable into the shards); inside a metadist.meta engine every path "
            "sees the full parameters")
