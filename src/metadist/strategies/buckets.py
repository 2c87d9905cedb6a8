"""Gradient buckets and the backward-driven reducer behind ddp, zero1 and zero2.

Data path: backward accumulates into a leaf's ``.grad``; that parameter's post-accumulate-grad
hook marks it ready in its bucket; a complete bucket launches an async collective on its flat
buffer (buckets launch strictly in index order, the same on every rank); the end of backward
(an autograd callback) launches what is left and waits; the optimizer then steps on averaged
gradients that are views into the bucket buffers.

Semantics:
* Only accumulation into ``.grad`` syncs. ``torch.autograd.grad`` (inner loops) never fires the
  hooks, so inner-loop gradients stay local; any number of forwards per step is fine.
* Every backward that accumulates ends synced, whichever optimizer steps afterwards (one
  built after setup included): nothing waits for an optimizer hook to say a step began. A
  second backward in a step adds its local gradients to the synced average; every rank
  then holds ``avg_previous + local_new`` and, because ``avg_previous`` is identical
  everywhere, the weighted sum of those buffers is exactly ``avg_previous + mean(local_new)``.
  (Accumulating micro-batches locally is what ``no_sync`` is for.)
* Each bucket carries one flag per parameter ("had a gradient here"), summed with the
  gradients, so a parameter no rank touched keeps ``grad=None`` on every rank with no extra
  collective and no user flag.
* zero2 owners: a bucket's result is kept by its owner only; other ranks drop the gradients
  at once. The owner scales its own incoming gradient as autograd accumulates it (a tensor
  hook that acts only when autograd will accumulate into ``.grad``, not in
  ``autograd.grad``), and its bucket is launched unscaled: the average it already holds
  plus everyone's scaled new gradients is again exact.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from metadist.comm import ops
from metadist.comm.handle import Handle
from metadist.runtime.world import Group
from metadist.strategies import agreement
from metadist.strategies.tensors.elsewhere import ElsewhereGrad, OwnedGrad, held_grad


class _State(enum.Enum):
    IDLE = "idle"  # no accumulating backward in flight: gradients are synced (or no_sync's)
    RUNNING = "running"  # a backward is in flight; its buckets launch as they fill


@dataclass
class Bucket:
    """Flat gradients of a few parameters of one dtype/device, reduced by one collective."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device
    owner: int | None  # the rank that keeps the result (zero2), or None: every rank
    persistent: bool  # buffer kept between steps (its views are the gradients)
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    pending: int = 0
    handle: Handle | None = None
    wire: torch.Tensor | None = None  # a reduce_dtype copy of the buffer while in flight

    def wait(self) -> None:
        """Finish the collective; copy a reduce_dtype result back into the buffer."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.wire is not None:
            if self.persistent and self.buffer is not None:
                self.buffer.copy_(self.wire)
            self.wire = None

    @property
    def size(self) -> int:
        return self.numel + len(self.params)  # grads, then one "had a gradient" flag each

    def allocate(self, storage: torch.Tensor | None = None) -> torch.Tensor:
        if self.buffer is None:
            if storage is None:
                storage = torch.zeros(self.size, dtype=self.dtype, device=self.device)
            self.buffer = storage[:self.size]
            self.views = [self.buffer[o:o + p.numel()].view_as(p)
                          for p, o in zip(self.params, self.offsets, strict=True)]
        return self.buffer

    def release(self) -> torch.Tensor | None:
        buffer, self.buffer, self.views = self.buffer, None, []
        return buffer


def plan_grad_buckets(params: Sequence[nn.Parameter], cap_bytes: int, first_cap_bytes: int,
                 owners: Sequence[int] | None) -> list[list[int]]:
    """Indices of ``params`` per bucket: reverse registration order (the order backward
    produces gradients), one dtype/device/owner per bucket, capped in bytes."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    key: tuple[object, ...] | None = None
    for i in reversed(range(len(params))):
        p = params[i]
        k = (p.dtype, p.device, owners[i] if owners is not None else None)
        nbytes = p.numel() * p.element_size()
        cap = first_cap_bytes if not buckets else cap_bytes
        if current and (k != key or size + nbytes > cap):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        key = k
    if current:
        buckets.append(current)
    return buckets


def will_accumulate(node: torch.autograd.graph.Node) -> bool:
    """Whether the running backward will accumulate into the ``.grad`` of the leaf whose
    AccumulateGrad node is ``node`` (False inside ``torch.autograd.grad``)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # raised for leaves while autograd.grad() runs: nothing accumulates
        return False


def _accumulate_node(p: nn.Parameter) -> torch.autograd.graph.Node:
    """The parameter's AccumulateGrad node."""
    grad_fn = p.view_as(p).grad_fn
    assert grad_fn is not None
    node = grad_fn.next_functions[0][0]
    assert node is not None
    return node


class Reducer:
    """Averages (or reduces to owners) the gradients of ``params`` as backward produces them."""

    def __init__(self, params: Sequence[nn.Parameter], *, scale: Callable[[], float],
                 bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 owners: Sequence[int] | None = None, group: Group = None,
                 reduce_dtype: torch.dtype | None = None,
                 names: Sequence[str] | None = None) -> None:
        self.params = list(params)
        # zero2: other owners' gradients are placeholders that name their parameter
        self._names = dict(zip(self.params, names or [f"parameter {i}" for i in
                                                      range(len(self.params))], strict=True))
        self.scale = scale
        self._reduce_dtype = reduce_dtype
        self._group = group
        self._rank = ops.group_info(group)[2]
        plan = plan_grad_buckets(self.params, int(bucket_cap_mb * 2**20),
                            int(first_bucket_mb * 2**20), owners)
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        for index, members in enumerate(plan):
            ps = [self.params[i] for i in members]
            offsets, total = [], 0
            for p in ps:
                offsets.append(total)
                total += p.numel()
            owner = owners[members[0]] if owners is not None else None
            keep = owner is None or owner == self._rank
            bucket = Bucket(index, ps, offsets, total, ps[0].dtype, ps[0].device, owner, keep)
            if keep:
                bucket.allocate()
            self.buckets.append(bucket)
            for p in ps:
                self._bucket_of[p] = bucket
        # zero2: scratch buffers of other owners' buckets, reused across buckets and steps so
        # no step pays fresh allocations; at most two such buckets are in flight at once.
        self._pool: list[torch.Tensor] = []
        self._in_flight: deque[Bucket] = deque()
        self._scratch_size = max((b.size for b in self.buckets if not b.persistent), default=0)
        self._state = _State.IDLE
        self._next = 0
        self._sync_enabled = True
        self._local_unsynced = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
            if self._bucket_of[p].owner == self._rank:
                p.register_hook(self._owner_pre_hook(p))
            elif self._bucket_of[p].owner is not None:
                p.register_hook(self._other_pre_hook(p))

    # ----- hooks -------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync_enabled:
            self._local_unsynced = True
            return
        if self._state is _State.IDLE:
            self._state = _State.RUNNING
            self._next = 0
            for b in self.buckets:
                b.pending = len(b.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self._bucket_of[p]  # type: ignore[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_in_order()

    def _owner_pre_hook(self, p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor | None]:
        node = _accumulate_node(p)

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            # Only when autograd is about to accumulate into .grad (not autograd.grad): the
            # owner's .grad may already hold a reduced average, which must not be scaled again.
            if not will_accumulate(node):
                return None
            scale = self.scale()
            return torch.zeros_like(grad) if scale == 0.0 else grad * scale

        return hook

    def _end_of_backward(self) -> None:
        if self._state is not _State.RUNNING:
            return
        agreement.count_backward()
        self._launch_in_order(everything=True)
        self._finish()

    @staticmethod
    def _other_pre_hook(p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        node = _accumulate_node(p)

        def hook(grad: torch.Tensor) -> None:
            # zero2, another rank's parameter: a backward accumulates afresh, never into the
            # placeholder (an in-place change of one does nothing: strategies/tensors/elsewhere.py)
            if isinstance(p.grad, ElsewhereGrad) and will_accumulate(node):
                p.grad = None

        return hook

    # ----- launching -----------------------------------------------------------------------
    def _launch_in_order(self, everything: bool = False) -> None:
        while self._next < len(self.buckets) and (
                everything or self.buckets[self._next].pending == 0):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _scratch(self, b: Bucket) -> torch.Tensor:
        self._retire(keep=1)
        for i, t in enumerate(self._pool):
            if t.dtype == b.dtype and t.device == b.device:
                return self._pool.pop(i)
        return torch.empty(self._scratch_size, dtype=b.dtype, device=b.device)

    def _retire(self, keep: int) -> None:
        """Finish other owners' buckets in flight beyond the newest ``keep``."""
        while len(self._in_flight) > keep:
            b = self._in_flight.popleft()
            b.wait()
            storage = b.release()
            if storage is not None and len(self._pool) < 2:
                self._pool.append(storage._base if storage._base is not None else storage)

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        buf = b.allocate(None if b.persistent else self._scratch(b))
        had_grad = []
        for p, view in zip(b.params, b.views, strict=True):
            g = held_grad(p)
            had_grad.append(g is not None)
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                if g.is_sparse:
                    raise ValueError("sparse gradients are not supported by this strategy; use "
                                     "dense embeddings (sparse=False)")
                view.copy_(g)
            if not b.persistent:  # zero2: another rank owns it; free it at once
                assert b.owner is not None
                p.grad = ElsewhereGrad.like(p, b.owner, self._names[p], self._group)
        buf[b.numel:].copy_(torch.tensor(had_grad, dtype=buf.dtype))
        if b.owner != self._rank:  # an owner's own gradients arrive pre-scaled
            scale = self.scale()
            grads = buf[:b.numel]
            if scale == 0.0:
                grads.zero_()  # a stand-in batch: contributes nothing, not even NaN
            elif scale != 1.0:
                grads.mul_(scale)
        if self._reduce_dtype is not None and self._reduce_dtype != buf.dtype:
            # scaled above, so a low-precision sum of per-rank shares does not overflow
            b.wire = buf = buf.to(self._reduce_dtype)
        if b.owner is None:
            b.handle = ops.all_reduce(buf, "sum", group=self._group, async_op=True)
        else:
            b.handle = ops.reduce(buf, b.owner, "sum", group=self._group, async_op=True)
        if not b.persistent:
            self._in_flight.append(b)

    @torch.no_grad()
    def _finish(self) -> None:
        self._retire(keep=0)
        for b in self.buckets:
            if not b.persistent:
                continue
            assert b.handle is not None and b.buffer is not None
            b.wait()
            used = (b.buffer[b.numel:] > 0).tolist()
            for p, view, was_used in zip(b.params, b.views, used, strict=True):
                if was_used:  # zero2: the owner's gradient, typed (strategies/tensors/)
                    p.grad = view if b.owner is None else OwnedGrad.of(
                        view, b.owner, self._names[p], self._group)
                # else: no rank had a gradient; p.grad stays as the user left it
        self._state = _State.IDLE
        self._local_unsynced = False

    # ----- the step ----------------------------------------------------------------------
    def sync(self) -> None:
        """Sync gradients accumulated under ``no_sync`` now (before ``step`` / clipping),
        if no backward outside it has synced them yet."""
        if self._local_unsynced and self._state is not _State.RUNNING:
            self._next = 0
            self._launch_in_order(everything=True)
            self._finish()

    def set_sync_enabled(self, enabled: bool) -> bool:
        previous, self._sync_enabled = self._sync_enabled, enabled
        return previous
