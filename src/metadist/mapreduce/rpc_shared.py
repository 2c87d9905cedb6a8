"""Gradients of a tensor shared by a map's calls, summed in call order (rpc engine).

torch's distributed autograd adds the gradients that come back to the driver for one tensor
sent to several calls in the order they arrive, so float32 rounding followed the workers'
timing and the same program gave different numbers run to run (BatchNorm and Adam then carry
the difference into every later step). Here each such tensor is handed to the n calls as n
views made by one autograd node (:class:`_FanOut`): the engine runs its backward only once
all n gradients are in, one per input slot, and it adds them in call order, whatever order
they arrived in. (``expand`` + ``unbind`` would wait too, but its backward sums a stack with
torch's reduction kernel, whose grouping is not call order; this sums left to right.)

Covered: tensors in the graph anywhere in a call's arguments, the parameters of modules
among them, and modules behind a remote reference this process owns (TorchOpt's examples send
the network that way: every call fetches it with ``to_here()``), each call getting a
reference of its own. Only inside a distributed autograd context with grad enabled: outside
one no gradient comes back. A call's views are views: modify them in place on the calling
rank and autograd refuses (outputs of one function returning several views); remote calls
get copies.
Not covered: distinct tensors sent to different calls that overlap in memory (custom
partitioners' overlapping windows of one tensor); disjoint slices need nothing, their sum is
exact in any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from metadist.mapreduce import trees
from metadist.mapreduce.modules import copy_module
from metadist.mapreduce.partitioners import Part


def _rref_type() -> Any:
    try:
        from torch.distributed import rpc

        return rpc.RRef
    except ImportError:
        return None


class _FanOut(torch.autograd.Function):
    """n views of one tensor; backward: their gradients added in view order."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # a call that does not use its view sends nothing
        return tuple(t.view_as(t) for _ in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        total: torch.Tensor | None = None
        for g in grads:
            if g is not None:
                total = g if total is None else total + g
        return total, None


def _in_context() -> bool:
    """Whether gradients can come back: grad mode on inside a distributed autograd context."""
    if not torch.is_grad_enabled():
        return False
    import torch.distributed.autograd as dist_autograd

    try:
        dist_autograd._current_context()  # type: ignore[attr-defined]
    except RuntimeError:  # "Current thread doesn't have a valid autograd context"
        return False
    return True


def _local_module(leaf: Any, rref: Any) -> nn.Module | None:
    """The module behind a remote reference owned here, else None."""
    if rref is None or not isinstance(leaf, rref) or not leaf.is_owner():
        return None
    value = leaf.local_value()
    return value if isinstance(value, nn.Module) else None


def _in_graph(t: torch.Tensor) -> bool:
    """Whether ``t`` travels with its gradient. A ``Parameter`` arrives detached on another
    rank (pytorch#86525; prepare() sends clones of the ones it sees): left as it is, so that
    only the order of the gradients changes here, never whether there are any."""
    return t.requires_grad and not isinstance(t, nn.Parameter)


def _grad_tensors(leaf: Any, rref: Any) -> Iterator[torch.Tensor]:
    if isinstance(leaf, torch.Tensor):
        if _in_graph(leaf):
            yield leaf
        return
    module = leaf if isinstance(leaf, nn.Module) else _local_module(leaf, rref)
    if module is not None:
        for sub in module.modules():
            yield from (p for p in sub._parameters.values() if p is not None and _in_graph(p))


def in_call_order(parts: list[Part]) -> list[Part]:
    """``parts`` with every tensor that requires grad and reaches several of them replaced by
    per-part views of one autograd node (see the module notes); other parts unchanged."""
    if len(parts) < 2 or not _in_context():
        return parts
    rref = _rref_type()
    reached: dict[int, list[int]] = {}  # id(tensor) -> the parts it reaches, in order
    tensors: dict[int, torch.Tensor] = {}
    for index, part in enumerate(parts):
        for leaf in trees.leaves((part.args, part.kwargs)):
            for t in _grad_tensors(leaf, rref):
                where = reached.setdefault(id(t), [])
                if not where or where[-1] != index:
                    where.append(index)
                tensors[id(t)] = t
    shared = {key: dict(zip(where, _FanOut.apply(tensors[key], len(where)), strict=True))
              for key, where in reached.items() if len(where) > 1}
    if not shared:
        return parts
    return [_rebind(index, part, shared, rref) for index, part in enumerate(parts)]


def _rebind(index: int, part: Part, shared: dict[int, dict[int, torch.Tensor]],
            rref: Any) -> Part:
    """Part ``index`` with its shared tensors replaced by its own views."""
    memo: dict[int, nn.Module] = {}  # one copy per module within the part

    def view(t: torch.Tensor) -> torch.Tensor:
        views = shared.get(id(t))
        return t if views is None else views[index]

    def uses_shared(module: nn.Module) -> bool:
        return any(id(p) in shared for sub in module.modules()
                   for p in sub._parameters.values() if p is not None)

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return view(leaf)
        if isinstance(leaf, nn.Module):
            return copy_module(leaf, view, lambda b: b, memo) if uses_shared(leaf) else leaf
        module = _local_module(leaf, rref)
        if module is not None and rref is not None and uses_shared(module):
            # A reference of the part's own: to_here() (local or remote) gives its views.
            return rref(copy_module(module, view, lambda b: b, memo))
        return leaf

    new_args, new_kwargs = trees.tree_map(convert, (part.args, part.kwargs))
    return Part(part.worker, tuple(new_args), dict(new_kwargs))


__all__ = ["in_call_order"]
