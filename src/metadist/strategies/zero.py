"""``"zero1"`` (optimizer state sharding) and ``"zero2"`` (+ gradient sharding).

Parameters are replicated; each one has an owner rank from a size-balanced partition that is
contiguous in backward order (so zero2's buckets rarely straddle owners). The optimizer steps
only owned parameters; afterwards each owner broadcasts its updated parameters from a flat
region of exactly their size, which the parameters are views into (no copies, no padding).

* zero1: gradients are all-reduced in buckets exactly as in ddp; optimizer state is O/N.
* zero2: each bucket is reduced to its owner as it fills (overlapping backward) and the other
  ranks drop those gradients at once: gradients and optimizer state are (G+O)/N. The reduce
  primitive is chosen per backend by ``comm`` (gloo: an in-place all-reduce, faster there).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from metadist.comm import ops
from metadist.comm.handle import Handle
from metadist.strategies import step_chain
from metadist.strategies.buckets import Reducer
from metadist.strategies.ddp import DDPConfig, DDPStrategy, ReplicatedModule, prepare_replicated
from metadist.strategies.module import DistributedModule
from metadist.strategies.placement import OptimizerPlacement, Stepped, whole_tensor
from metadist.strategies.registry import register
from metadist.strategies.sharded_optim import OptimizerLayout, shard_optimizer
from metadist.strategies.tensors import grad_norm
from metadist.strategies.tensors.grad_norm import Split


def balanced_partition(sizes: list[int], parts: int) -> list[int]:
    """Owner of each item: ``parts`` contiguous runs. The largest run's total is the smallest
    possible; within that bound each run ends where the rest splits most evenly over the
    remaining parts (greedy filling up to the bound would leave the last runs light or empty).
    """
    if not sizes:
        return []
    n, prefix = len(sizes), list(accumulate(sizes, initial=0))

    def end(start: int, cap: int) -> int:  # the furthest end of a run from start within cap
        return bisect_right(prefix, prefix[start] + cap) - 1

    def runs(cap: int) -> int:
        count, start = 0, 0
        while start < n:
            start, count = end(start, cap), count + 1
        return count

    lo, hi = max(sizes), prefix[-1]
    while lo < hi:  # smallest cap that fits in `parts` runs
        mid = (lo + hi) // 2
        if runs(mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    need = [0] * (n + 1)  # fewest runs within the cap that cover items i.. (greedy is optimal)
    for i in range(n - 1, -1, -1):
        need[i] = 1 + need[end(i, lo)]
    rising = [-k for k in need]  # need falls towards the end: negated, it can be bisected
    owners: list[int] = []
    start = 0
    for part in range(parts):
        if start == n:
            break
        left = parts - part
        first = bisect_left(rising, 1 - left, start)  # the rest fits in the other parts
        last = end(start, lo)  # candidate ends first..last keep the rest feasible
        target = prefix[start] + (prefix[n] - prefix[start]) / left
        stop = min(max(bisect_left(prefix, target, first, last + 1), first), last)
        if stop > first and target - prefix[stop - 1] < prefix[stop] - target:
            stop -= 1
        owners += [part] * (stop - start)
        start = stop
    return owners


class OwnerLayout(OptimizerLayout):
    """Whole parameters, each stepped by its owner rank."""

    def __init__(self, owner: dict[torch.Tensor, int], rank: int, world_size: int) -> None:
        self.owner, self.rank = owner, rank
        counts = [sum(1 for o in owner.values() if o == r) for r in range(world_size)]
        self.signature = f"owner/{world_size}/{rank}/{counts}"

    def local_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p for p in params if self.owner.get(p, self.rank) == self.rank]

    def placements(self, original_groups: list[list[torch.Tensor]]) -> OptimizerPlacement:
        original = [p for g in original_groups for p in g]
        stepped = [Stepped(p, (whole_tensor(str(i), p, "holder"),), True)
                   for i, p in enumerate(original) if self.owner.get(p, self.rank) == self.rank]
        return OptimizerPlacement(tuple(tuple(p.shape) for p in original),
                                  tuple(len(g) for g in original_groups), tuple(stepped))


@dataclass(frozen=True)
class _Piece:
    """A contiguous run of one owner's parameters in a flat buffer, sent by one broadcast."""

    flat: int
    owner: int
    start: int
    length: int


class ParamGather:
    """Replicated parameters laid out in flat per-owner regions, so that after the owners
    step every rank's copy is refreshed in place with no copies. Each owner's region is
    exactly its parameters (per dtype and device): a rank holds P, whatever the partition.

    Synchronous (the default): one broadcast per owner region, finished inside ``step()``,
    so the refresh is complete before anything can read a parameter. Overlapped (opt-in):
    one broadcast per piece (a few MiB of one owner's parameters, in forward order)
    launched after ``step()``; each module waits for its own pieces just before its
    forward, so the transfer of later layers overlaps the computation of earlier ones.
    """

    def __init__(self, params: list[nn.Parameter], owners: list[int], world_size: int,
                 rank: int, piece_bytes: int = 4 << 20) -> None:
        self.rank = rank
        self.flats: list[torch.Tensor] = []
        self.regions: list[_Piece] = []  # each owner's whole region, per flat
        where: dict[nn.Parameter, tuple[int, int, int]] = {}  # flat, owner, offset
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[nn.Parameter, int]]] = {}
        for p, o in zip(params, owners, strict=True):
            by_kind.setdefault((p.dtype, p.device), []).append((p, o))
        for index, ((dtype, device), members) in enumerate(by_kind.items()):
            totals = [sum(p.numel() for p, o in members if o == r) for r in range(world_size)]
            starts = [0, *accumulate(totals)]
            flat = torch.zeros(starts[-1], dtype=dtype, device=device)
            offsets = starts[:-1]
            self.regions += [_Piece(index, r, starts[r], totals[r])
                             for r in range(world_size) if totals[r]]
            with torch.no_grad():
                for p, o in members:  # registration order within each owner's region
                    view = flat[offsets[o]:offsets[o] + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view  # same Parameter object: optimizers keep their references
                    where[p] = (index, o, offsets[o])
                    offsets[o] += p.numel()
            self.flats.append(flat)
        self.pieces: list[_Piece] = []
        self.pieces_of: dict[nn.Parameter, list[int]] = {}
        for p in params:  # forward (registration) order
            index, owner, offset = where[p]
            last = self.pieces[-1] if self.pieces else None
            nbytes = p.numel() * p.element_size()
            if (last is not None and (last.flat, last.owner) == (index, owner)
                    and last.start + last.length == offset
                    and (last.length + p.numel()) * p.element_size() <= max(piece_bytes, nbytes)):
                self.pieces[-1] = _Piece(index, owner, last.start, last.length + p.numel())
            else:
                self.pieces.append(_Piece(index, owner, offset, p.numel()))
            self.pieces_of[p] = [len(self.pieces) - 1]
        self._piece_handles: list[Handle | None] = [None] * len(self.pieces)

    def gather(self, overlap: bool) -> None:
        """Refresh everyone's parameters from their owners."""
        self.wait()
        if not overlap:  # regions differ in size: one broadcast each, not an all-gather
            handles = [ops.broadcast(self.flats[r.flat].narrow(0, r.start, r.length), r.owner,
                                     async_op=True) for r in self.regions]
            for handle in handles:
                handle.wait()
            return
        for i, piece in enumerate(self.pieces):
            flat = self.flats[piece.flat]
            self._piece_handles[i] = ops.broadcast(
                flat.narrow(0, piece.start, piece.length), piece.owner, async_op=True)

    def wait_for(self, params: list[nn.Parameter]) -> None:
        """Finish the broadcasts that carry ``params`` (before they are read)."""
        for p in params:
            for i in self.pieces_of.get(p, ()):
                handle = self._piece_handles[i]
                if handle is not None:
                    handle.wait()
                    self._piece_handles[i] = None

    def wait(self) -> None:
        """Finish every broadcast in flight."""
        for i, handle in enumerate(self._piece_handles):
            if handle is not None:
                handle.wait()
                self._piece_handles[i] = None


class ZeroModule(ReplicatedModule):
    """A replicated module whose parameters are refreshed by owners after each step."""

    def __init__(self, module: nn.Module, reducer: Reducer | None, gather: ParamGather | None,
                 broadcast_buffers: bool, owners: dict[torch.Tensor, int] | None = None,
                 overlap: bool = False) -> None:
        super().__init__(module, reducer, broadcast_buffers)
        self.gather = gather
        self.owners = owners or {}
        if gather is not None and overlap:
            # With overlapped refreshes, each module waits for its own parameters just before
            # its forward, and any state_dict of the user's module waits for all of them.
            for m in module.modules():
                mine = [p for p in m.parameters(recurse=False) if p in gather.pieces_of]
                if mine:
                    m.register_forward_pre_hook(lambda _m, _a, mine=mine: gather.wait_for(mine))
            module.register_state_dict_pre_hook(lambda *_: gather.wait())
            module.register_load_state_dict_pre_hook(lambda *_: gather.wait())

    def _dtype_bound_state(self) -> str | None:
        if self.gather is not None:
            return "gradient buckets and the owners' parameter regions"
        return super()._dtype_bound_state()

    def wait_params(self) -> None:
        if self.gather is not None:
            self.gather.wait()

    def split_gradients(self) -> dict[torch.Tensor, Split]:
        """zero2: each gradient is kept by the rank that owns its parameter only."""
        if self.reducer is None or all(b.owner is None for b in self.reducer.buckets):
            return {}  # zero1: gradients all-reduced, whole on every rank
        rank = ops.group_info(None)[2]
        return {p: Split(None, mine=owner == rank, shard=False)
                for p, owner in self.owners.items()}

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self.wait_params()  # model.parameters() after step() must not see pre-step values
        return super().named_parameters(*args, **kwargs)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        self.wait_params()
        return super().full_parameters()

    def functional_forward(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        self.wait_params()
        return super().functional_forward(params, *args, **kwargs)


@dataclass(frozen=True)
class ZeroConfig(DDPConfig):
    #: Off (the default): every rank's parameters are refreshed before ``step()`` returns,
    #: so no read after the step, by whatever path (``module._parameters``, ``.data``, a
    #: tensor kept from before, a copy), can see a pre-step value. On: the refresh runs
    #: asynchronously after ``step()`` and each module waits for its own parameters just
    #: before its forward (reads through the wrapped model wait too), overlapping the next
    #: forward; a read that bypasses the wrapper before then sees pre-step values (call
    #: ``model.wait_params()`` first).
    overlap_param_gather: bool = False


class _ZeroStrategy(DDPStrategy):
    Config = ZeroConfig
    config: ZeroConfig
    shard_gradients: ClassVar[bool]

    def _setup_module(self, model: nn.Module) -> ZeroModule:
        model = prepare_replicated(model, self.device, self.config.sync_batchnorm)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        trainable = [p for _, p in named]
        w = self.world
        if w.world_size == 1:
            return ZeroModule(model, None, None, False)
        # Contiguous in backward order (reverse registration), as the reducer's buckets are.
        order = list(reversed(range(len(trainable))))
        owner_in_order = balanced_partition(
            [trainable[i].numel() * trainable[i].element_size() for i in order], w.world_size)
        owners = [0] * len(trainable)
        for i, o in zip(order, owner_in_order, strict=True):
            owners[i] = o
        gather = ParamGather(trainable, owners, w.world_size, w.rank)
        reducer = Reducer(trainable, scale=self.reduce_factor,
                          bucket_cap_mb=self.config.bucket_cap_mb,
                          first_bucket_mb=self.config.first_bucket_mb,
                              reduce_dtype=self.reduce_dtype,
                          owners=owners if self.shard_gradients else None,
                          names=[n for n, _ in named])
        return ZeroModule(model, reducer, gather, self.config.broadcast_buffers,
                          dict(zip(trainable, owners, strict=True)),
                          overlap=self.config.overlap_param_gather)

    def _optimizer_needed(self) -> str | None:
        if self.world.world_size == 1:
            return super()._optimizer_needed()
        gradients = ("keeps each gradient only on the rank that owns its parameter, "
                     if self.shard_gradients else "")
        return (f"{self.name} {gradients}steps each parameter on its owner rank only and then "
                "refreshes every rank's copy from the owners, so an optimizer it never saw "
                "would skip the refresh" + (" and the ranks would drift apart"
                                            if self.shard_gradients else
                                            " and keep the whole optimizer state on every rank"))

    def _setup_optimizer(self, module: DistributedModule, optimizer: Optimizer) -> Optimizer:
        optimizer = super()._setup_optimizer(module, optimizer)  # moves state, hooks the reducer
        if not isinstance(module, ZeroModule) or module.gather is None:
            return optimizer
        w = self.world
        shard_optimizer(optimizer, OwnerLayout(module.owners, w.rank, w.world_size))
        gather = module.gather
        overlap = self.config.overlap_param_gather
        chain = step_chain.building(optimizer)
        chain.add("wait_params", gather.wait)
        chain.add("refresh_params", partial(gather.gather, overlap))
        return optimizer

    def _clip_grad_norm(self, module: DistributedModule, max_norm: float,
                        norm_type: float) -> torch.Tensor:
        if not (self.shard_gradients and isinstance(module, ZeroModule)
                and module.reducer is not None):
            return super()._clip_grad_norm(module, max_norm, norm_type)
        module.reducer.sync()
        # every rank passes every parameter: the owners' gradients count, once each
        return grad_norm.clip_grad_norm_(list(module.parameters()), max_norm, norm_type)


@register("zero1", "zero")
class Zero1Strategy(_ZeroStrategy):
    """ZeRO-1: optimizer state sharded; gradients all-reduced; owners refresh parameters."""

    shard_gradients = False


@register("zero2")
class Zero2Strategy(_ZeroStrategy):
    """ZeRO-2: optimizer state and gradients sharded; buckets reduced to their owners."""

    shard_gradients = True
