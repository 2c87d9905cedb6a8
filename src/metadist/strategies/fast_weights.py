"""Fast weights of a *cooperative* inner problem: the same code under every strategy.

An inner loop comes in two kinds. In a **per-rank** one each rank adapts its own task's fast
weights (``model.full_parameters()`` adapted functionally: MAML with one task per rank).
In a **cooperative** one the ranks of a group work on one inner problem together, its batch
split over them, so every rank holds the same fast weights: the inner gradient is the mean
over the group. A forward call cannot tell the two apart, so the cooperative kind is asked
for explicitly, with ``model.fast_weights()``:

    fast = model.fast_weights()
    for _ in range(steps):
        inner = loss_fn(model.functional_forward(fast, xs), ys)   # this rank's slice
        fast = fast - lr * fast.grad(inner, create_graph=True)   # the group's mean gradient
    strategy.backward(loss_fn(model.functional_forward(fast, xq), yq))

Under ``single``, ``ddp``, ``zero1`` and ``zero2`` the fast weights are full tensors and
:meth:`FastWeights.grad` averages over every rank (differentiably). Under ``zero3``/``hsdp``
they stay **shards**: each rank holds its slice of every unit's flat buffer, a forward
gathers one unit at a time, the tensors autograd saves from a gathered unit are kept as
shards and gathered again when a backward (or the backward of a backward) needs them, and the
inner gradient arrives already reduced into the shards (zero3/sharded_fast.py), so the
graph of K inner steps holds O(K P / N) parameters, not O(K P). The group is the world, but
under ``hsdp`` it is the node: replica groups work on different tasks.

[Note: uneven slices]
One process averages the inner loss over the whole batch. When the group's slices differ in
size (10 samples on 3 ranks: 4, 4, 2), the mean of the ranks' means would weight a sample of
a small slice more. So a forward on fast weights weighs itself: the group's slice sizes (dim
0 of the forward's first tensor argument) are summed in one small collective, and the
gradient flowing back into the forward's outputs is scaled by this rank's share of the batch
relative to an even split (``w = n * size / total``; exactly 1 for an even split, where
nothing is scaled). A loss that is a mean over a rank's slice then weighs each sample as one
process does in a backward, the outer one included, with no argument to pass. A gradient
that is differentiated again cannot be weighted at the outputs (a loss's second derivative
would take ``w`` twice), so :meth:`FastWeights.grad` moves the weight of the forwards its
inner loss reads from their outputs to the loss itself, exact at every order.
:meth:`FastWeights.split` takes this rank's slice (sizes differ by one at most).

Arithmetic is element-wise on the pieces (``+ - * /``, :meth:`map` for any element-wise
function, e.g. Adam's update); :meth:`dot` and :meth:`norm` reduce over the group (one
collective). Anything else that would need a whole parameter goes through
``model.functional_forward`` or raises.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, register_pytree_node, tree_leaves, tree_map_only

from metadist.strategies.tensors.policy import ElementWise
from metadist.strategies.tensors.shard_piece import as_piece, plain, shard_internals


class FastLayout(Protocol):
    """How a strategy holds fast weights: its pieces, the group that shares them, and how
    the group's gradient and reductions are formed."""

    names: tuple[str, ...]  # the parameters, by the user's module's names
    sharded: bool  # pieces are slices of flat shards (zero3/hsdp), not whole parameters

    def group_size(self) -> int:
        """Ranks cooperating on one inner problem."""

    def group_rank(self) -> int:
        """This rank's index among them."""

    def replicas(self) -> tuple[int, int]:
        """(groups working on different inner problems, this rank's group's index)."""

    def reduce_sum(self, value: Tensor) -> Tensor:
        """Sum ``value`` (a scalar from this rank's pieces) over the group (differentiable)."""

    def grads(self, loss: Tensor, pieces: Sequence[Tensor], create_graph: bool,
              share: float | None) -> tuple[Tensor, ...]:
        """The group's mean gradient of ``loss`` with respect to ``pieces``."""

    def group(self) -> Any:
        """The process group of the ranks cooperating (None: the world)."""

    def like(self, values: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        """Pieces laid out like the fast weights from full tensors by name."""

    def full(self, pieces: Sequence[Tensor]) -> dict[str, Tensor]:
        """Full tensors by name (collective where pieces are shards)."""

    def mean_of_local(self, grads: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Sharded layouts: the mean over ranks of every rank's own gradient, from
        gradients taken with respect to the pieces (see zero3/sharded_fast.py)."""

    def recording(self) -> AbstractContextManager[Any]:
        """Around a backward that records a graph: keeps what it saves as shards."""


@dataclass(frozen=True, eq=False)
class FastWeights:
    """A cooperative inner problem's fast weights (see the module notes)."""

    layout: FastLayout
    pieces: tuple[Tensor, ...]

    def __post_init__(self) -> None:
        if self.layout.sharded:  # slices of shards: only element-wise (tensors/shard_piece.py)
            object.__setattr__(self, "pieces", tuple(as_piece(t) for t in self.pieces))

    # ----- arithmetic: element-wise on the pieces --------------------------------------------
    def map(self, fn: Callable[..., Tensor], *others: FastWeights | Tensor | float
            ) -> FastWeights:
        """``fn`` applied piece by piece (with the matching pieces of ``others``, or a
        scalar): ``fn`` must be element-wise, e.g. ``lambda m, v: m / (v.sqrt() + eps)``.
        A piece is a whole parameter under some strategies and a flat slice of several
        under zero3/hsdp, so anything else (a sum, a norm, a reshape) would mean different
        things: it raises under every strategy."""
        args = [self._pieces_of(o) for o in others]
        with ElementWise(_not_element_wise):
            return FastWeights(self.layout, tuple(fn(p, *(a[i] for a in args))
                                                  for i, p in enumerate(self.pieces)))

    def _pieces_of(self, other: FastWeights | Tensor | float) -> Sequence[Any]:
        if isinstance(other, FastWeights):
            if other.layout is not self.layout:
                raise ValueError("these fast weights belong to different models (or a "
                                 "different set-up); combine fast weights of one model")
            return other.pieces
        if isinstance(other, Tensor) and other.numel() != 1:
            raise TypeError(f"fast weights combine with scalars and with fast weights of the "
                            f"same model, not a tensor of shape {tuple(other.shape)}; lay it "
                            "out first with fast.like({name: tensor})")
        return [other] * len(self.pieces)

    def __add__(self, other: FastWeights | Tensor | float) -> FastWeights:
        return self.map(lambda a, b: a + b, other)

    __radd__ = __add__

    def __sub__(self, other: FastWeights | Tensor | float) -> FastWeights:
        return self.map(lambda a, b: a - b, other)

    def __rsub__(self, other: FastWeights | Tensor | float) -> FastWeights:
        return self.map(lambda a, b: b - a, other)

    def __mul__(self, other: FastWeights | Tensor | float) -> FastWeights:
        return self.map(lambda a, b: a * b, other)

    __rmul__ = __mul__

    def __truediv__(self, other: FastWeights | Tensor | float) -> FastWeights:
        return self.map(lambda a, b: a / b, other)

    def __neg__(self) -> FastWeights:
        return self.map(lambda a: -a)

    # ----- reductions over the group --------------------------------------------------------
    def dot(self, other: FastWeights) -> Tensor:
        """The inner product over every parameter (one collective where sharded)."""
        with shard_internals():
            local = sum(((a * b).sum() for a, b in zip(self.pieces, self._pieces_of(other),
                                                       strict=True)),
                        torch.zeros((), dtype=self.pieces[0].dtype,
                                    device=self.pieces[0].device))
            return plain(self.layout.reduce_sum(local))

    def norm(self, p: float = 2.0) -> Tensor:
        """The ``p``-norm over every parameter (one collective where sharded; finite p)."""
        if p == 2.0:
            return self.dot(self).sqrt()
        if not 0 < p < float("inf"):
            raise ValueError(f"fast.norm(p={p}): a p-norm over shards adds up from the ranks' "
                             "parts for a finite positive p; use p=2.0")
        zero = torch.zeros((), dtype=self.pieces[0].dtype, device=self.pieces[0].device)
        with shard_internals():
            local = sum((t.abs().pow(p).sum() for t in self.pieces), zero)
            return plain(self.layout.reduce_sum(local).pow(1.0 / p))

    # ----- gradients --------------------------------------------------------------------------
    def grad(self, loss: Tensor, *, create_graph: bool = True,
             share: float | None = None) -> FastWeights:
        """The gradient of the group's mean inner loss (``loss`` is this rank's, a mean over
        its slice of the batch), laid out like these fast weights. ``create_graph`` (the
        default) keeps it differentiable for second-order meta-gradients. Slices of
        different sizes are weighted by the forward already (module notes); ``share``, this
        rank's fraction of the group's batch, is then not needed, and if given must be that
        fraction."""
        if share is not None:
            _check_share(self.layout, share)
        if _UNEVEN.get(self.layout):
            loss = loss * _weight_at_loss(loss, self.pieces)
        return FastWeights(self.layout, self.layout.grads(loss, self.pieces, create_graph,
                                                          None))

    def split(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        """This rank's slice (along dim 0) of each of ``tensors``, the inner problem's batch
        shared by the group: ``torch.tensor_split`` into :attr:`group_size` parts, sizes
        differing by one at most. Forwards on these fast weights weigh uneven slices
        themselves (module notes)."""
        size, rank = self.group_size, self.group_rank
        return tuple(torch.tensor_split(t, size)[rank] for t in tensors)

    # ----- conversions ----------------------------------------------------------------------
    def like(self, values: Mapping[str, Tensor]) -> FastWeights:
        """Full tensors by parameter name (e.g. learned per-parameter learning rates) laid
        out like these fast weights, differentiably."""
        return FastWeights(self.layout, self.layout.like(values))

    def zeros_like(self) -> FastWeights:
        return self.map(torch.zeros_like)

    def detach(self) -> FastWeights:
        return self.map(lambda t: t.detach())

    def requires_grad_(self, requires_grad: bool = True) -> FastWeights:
        """Every piece made a leaf that gradients are taken with respect to (of detached fast
        weights: hyperparameters for the hypergradient functions), in place; returns self."""
        for t in self.pieces:
            t.requires_grad_(requires_grad)
        return self

    def full(self) -> dict[str, Tensor]:
        """Every parameter whole, by name (collective where sharded): for inspection."""
        return self.layout.full(self.pieces)

    @property
    def group_size(self) -> int:
        """Ranks cooperating on this inner problem (split its batch over this many)."""
        return self.layout.group_size()

    @property
    def group_rank(self) -> int:
        """This rank's place among them (it takes that slice of the inner batch)."""
        return self.layout.group_rank()

    @property
    def groups(self) -> int:
        """Groups working on different inner problems at once (hsdp's replica groups; 1
        elsewhere): a meta-batch of tasks is split over them."""
        return self.layout.replicas()[0]

    @property
    def group_index(self) -> int:
        """This rank's group among :attr:`groups` (it takes that share of the tasks)."""
        return self.layout.replicas()[1]


# A pytree node: the hypergradient functions (metadist.meta) take fast weights as params.
register_pytree_node(FastWeights, lambda f: (list(f.pieces), f.layout),
                     lambda pieces, layout: FastWeights(layout, tuple(pieces)),
                     serialized_type_name="metadist.FastWeights")


def layout_of(spec: TreeSpec) -> Any:
    """The layout when a flattened pytree is fast weights (its leaves their pieces)."""
    return spec.context if spec.type is FastWeights else None


def _not_element_wise(op: str) -> str:
    return (f"fast-weight arithmetic ran {op}, which is not element-wise: a piece of fast "
            "weights is a whole parameter under some strategies and a flat slice of several "
            "under zero3/hsdp, so it would mean different things. Use fast.dot(other) or "
            "fast.norm() for a sum over every parameter (one collective where sharded), "
            "fast.like({name: tensor}) for per-parameter values (a learning rate per "
            "parameter), or model.functional_forward(fast, ...) for anything that needs "
            "whole parameters")


class ReplicatedLayout:
    """Fast weights as full tensors, identical on every rank (single, dp, ddp, zero1,
    zero2): the group is every rank, and the inner gradient their mean."""

    sharded = False

    def __init__(self, names: Sequence[str], scale: Callable[[], float] | None) -> None:
        self.names = tuple(names)
        self.scale = scale  # the strategy's batch weight of this rank (None: one rank)

    def group_size(self) -> int:
        from metadist.comm import ops

        return ops.group_info(None)[1] if _distributed() else 1

    def group_rank(self) -> int:
        from metadist.comm import ops

        return ops.group_info(None)[2] if _distributed() else 0

    def replicas(self) -> tuple[int, int]:
        return 1, 0

    def group(self) -> Any:
        return None

    def reduce_sum(self, value: Tensor) -> Tensor:
        return value  # the pieces are whole and the same on every rank

    def grads(self, loss: Tensor, pieces: Sequence[Tensor], create_graph: bool,
              share: float | None) -> tuple[Tensor, ...]:
        from metadist.comm import functional

        out = torch.autograd.grad(loss, list(pieces), create_graph=create_graph,
                                  allow_unused=True, materialize_grads=True)
        size = self.group_size()
        if size == 1:
            return tuple(out)
        if self.scale is not None:
            check_even_weights(self.scale())
        return tuple(functional.all_reduce_many([g / size for g in out], "sum"))

    def like(self, values: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        require_all(self.names, values)
        return tuple(values[n] for n in self.names)

    def full(self, pieces: Sequence[Tensor]) -> dict[str, Tensor]:
        return dict(zip(self.names, pieces, strict=True))

    def mean_of_local(self, grads: Sequence[Tensor]) -> tuple[Tensor, ...]:
        raise TypeError("whole fast weights have local gradients: sync them with grad_sync")

    def recording(self) -> AbstractContextManager[Any]:
        return nullcontext()


def require_all(names: Sequence[str], values: Mapping[str, Tensor]) -> None:
    """Raise unless ``values`` has a tensor for every name (``fast.like``)."""
    missing = [n for n in names if n not in values]
    if missing:
        raise KeyError(f"fast.like() needs a tensor for every trainable parameter; missing "
                       f"{missing[:4]}{' ...' if len(missing) > 4 else ''}")


def check_even_weights(weight: float) -> None:
    """Raise unless every rank weights its loss alike (one small collective).

    A cooperative inner problem mixes every rank's outer loss into the gradient on its way
    back (through the group's inner gradients), before any one rank's batch weight could be
    applied to its own part: the meta-gradient is exact for equal weights only."""
    from metadist.comm import ops

    both = torch.tensor([weight, -weight], dtype=torch.float64)
    ops.all_reduce(both, "max")
    high, low = float(both[0]), -float(both[1])
    if high != low:
        raise ValueError(
            f"cooperative fast weights (model.fast_weights()) need every rank to weight its "
            f"loss alike, but the ranks' batch weights run from {low:.6g} to {high:.6g} (a "
            "ragged last batch of a distributed loader, or set_batch_weight): give every rank "
            "an equal slice of the batch (drop_last=True), or weight the losses yourself and "
            "call strategy.set_batch_weight(1, world_size) on every rank")


#: each layout's share of the last forward on its fast weights (module notes), this rank's
_SHARES: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
#: the layouts a forward on uneven slices ran on
_UNEVEN: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


class _Weigh(torch.autograd.Function):
    """The identity, whose gradient is scaled by ``factor``: a forward's outputs weighted
    for a backward (module notes). Its node keeps ``factor``, which
    :func:`_weight_at_loss` sets to 1 when the weight moves to a loss."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return (grad if ctx.factor == 1.0 else grad * ctx.factor), None


def _weight_at_loss(loss: Tensor, pieces: Sequence[Tensor]) -> float:
    """The weight of the forwards ``loss`` reads (their weighted outputs, found walking its
    graph back to them or to ``pieces``), unset at their outputs: the loss carries it."""
    stops = {p.grad_fn for p in pieces if p.grad_fn is not None}
    weigh = _Weigh._backward_cls
    found: list[Any] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        if isinstance(node, weigh):
            found.append(node)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    factors = {node.factor for node in found if node.factor != 1.0}
    if len(factors) > 1:
        raise ValueError(
            "this inner loss reads forwards on slices of different shares of their batches "
            f"({', '.join(f'{f:.4g}' for f in sorted(factors))} of an even split): its "
            "gradient cannot weigh each sample as one process does. Differentiate each "
            "batch's loss in a fast.grad of its own, or split the batches alike")
    for node in found:
        node.factor = 1.0
    return factors.pop() if factors else 1.0


def weigh_slice(layout: FastLayout, out: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    """A forward's outputs ``out`` on fast weights of ``layout``, weighted by this rank's
    share of the group's batch (module notes): one small collective over the group."""
    from metadist.comm import ops

    size = layout.group_size()
    if size == 1:
        return out
    first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
                  and t.dim() > 0), None)
    if first is None:
        return out
    count = torch.tensor([float(first.shape[0])], dtype=torch.float64, device=first.device)
    ops.all_reduce(count, "sum", group=layout.group())
    total = float(count)
    factor = first.shape[0] * size / total if total > 0 else 1.0
    _SHARES[layout] = factor / size
    if factor == 1.0:
        return out
    _UNEVEN[layout] = True
    return tree_map_only(Tensor, lambda t: _Weigh.apply(t, factor)
                         if t.requires_grad and t.is_floating_point() else t, out)


def _check_share(layout: FastLayout, share: float) -> None:
    known = _SHARES.get(layout)
    if known is not None and abs(share - known) > 1e-12 * max(1.0, abs(known)):
        raise ValueError(
            f"fast.grad(..., share={share:.6g}), but this rank's slice is {known:.6g} of the "
            "group's batch in the last forward on these fast weights: forwards weigh uneven "
            "slices themselves, so leave share= out")


def _distributed() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())
