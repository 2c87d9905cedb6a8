"""zero3/hsdp: a set-up model run on tensors other than its own, by a path metadist cannot see.

Under zero3/hsdp each rank holds a slice of every parameter, and every forward gathers
all ranks' slices. A per-rank copy of the parameters (the fast weights of an inner
loop) therefore cannot be run by the paths that work under ddp: a clone whose parameters were
cloned into the graph (learn2learn's ``MAML.clone()``), a patched copy of the module class
(higher's ``innerloop_ctx``), ``torch.func.functional_call`` with the shards swapped, a deep
copy. Each is recognised where it first runs (the model's forward) and refused before any
value is computed, naming the path taken, the library on the stack, and the portable form.

Between its units' forwards the user's module holds :class:`~metadist.strategies.zero3.
sharded_param.ShardedParam` objects (this rank's slice of each parameter); where a known
library reads one to copy the model, the error names the library and the portable form.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from torch import nn

#: libraries whose meta-learning idioms reach a model by such paths, and by which calls
LIBRARIES = {
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
    own shards: ``swapped`` names the parameters (or shards) replaced by other tensors."""
    if id(model) == origin.id and type(model) is origin.type and not swapped:
        return
    library = library_on_stack()
    if type(model) is not origin.type:
        how, by = "a patched subclass of the set-up model", type(model).__module__
    elif id(model) != origin.id:
        shards: Any = model.shards
        cloned = any(p.grad_fn is not None for p in shards.parameters())
        how = ("a copy of the set-up model whose parameters were cloned into the graph"
               if cloned else "a copy of the set-up model")
        by = "copy.copy or copy.deepcopy"
    else:
        names = ", ".join(swapped[:3]) + (" ..." * (len(swapped) > 3))
        how = (f"the set-up model with its parameters ({names}) replaced by other tensors "
               "(of other shapes than the parameters: this rank's slices, say)")
        by = "torch.func.functional_call"
    if library is not None:
        by = f"{LIBRARIES[library]} (which runs as it is under ddp, zero1 and zero2)"
    raise RuntimeError(per_rank_copy(f"this forward runs {how}, made by {by}"))


def library_walking() -> bool:
    """Whether a known meta-learning library's code is running (only looked for once one
    is imported): it walks the model's registry itself, so the set-up model lists what that
    walk finds, and the library's first computation on a placeholder names it."""
    return any(name in sys.modules for name in LIBRARIES) and library_on_stack() is not None


def per_rank_copy(what: str) -> str:
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


def library_on_stack() -> str | None:
    """The first known library among the callers (its top-level package name)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        top = str(frame.f_globals.get("__name__", "")).split(".", 1)[0]
        if top in LIBRARIES:
            return top
        frame = frame.f_back
    return None
