"""The collectives, with string reduce ops, one handle type and shims for torch 2.5-2.15.

Every collective works in place on the tensors it is given and returns a :class:`Handle`;
with ``async_op=False`` the handle is already complete. ``src``/``dst`` are ranks *within*
``group``. A world of one, or the :data:`~metadist.runtime.world.SELF` group, makes every
collective the identity without touching torch.distributed.

Backend-aware choices live here, not in the strategies. On gloo, ``impl="auto"`` replaces
the slow native all_gather, reduce_scatter and reduce with faster constructions measured on
these machines (benchmarks/comm.py): point-to-point rings (comm/ring.py), one broadcast per
rank, or an in-place all-reduce. Other backends use the native collectives.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

from metadist.comm import alone, debug, ring, stats
from metadist.comm.debug import TensorSpec
from metadist.comm.handle import Handle
from metadist.runtime import watchdog
from metadist.runtime import world as _world
from metadist.runtime.tracker import TRACKER, CollectiveCall
from metadist.runtime.world import SELF, Group

ReduceOpName = Literal["sum", "mean", "max", "min", "prod"]
RING_MIN_BYTES = 1 << 20  # below this, a ring's N-1 latency-bound steps lose to one all_reduce
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")
Impl = Literal["auto", "native"]

# torch 2.13 renamed the single-tensor variants; older releases only have the former names.
all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
_reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)



def set_debug(enabled: bool) -> None:
    """Cross-check a fingerprint of every collective (call number, op, reduce op, root, dtypes
    and shapes) on every rank before running it: one extra small all-gather per call.

    A rank that skips, reorders or resizes a collective then fails, on every rank, with
    :class:`~metadist.errors.CollectiveMismatchError` naming the op, the differing field and
    the ranks. Also enabled by ``METADIST_DEBUG=1`` or ``metadist.init(debug=True)``.
    """
    TRACKER.debug = bool(enabled)


def debug_enabled() -> bool:
    return TRACKER.debug


def _torch_op(op: str) -> Any:
    match op:
        case "sum" | "mean":
            return dist.ReduceOp.SUM
        case "max":
            return dist.ReduceOp.MAX
        case "min":
            return dist.ReduceOp.MIN
        case "prod":
            return dist.ReduceOp.PRODUCT
        case _:
            raise ValueError(
                f"reduce op {op!r} is not known; choose one of: {', '.join(REDUCE_OPS)}")


def group_info(group: Group) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(process group or None, size, rank in group)``; size 1 means "identity"."""
    if group is SELF:
        return None, 1, 0
    w = _world.world()
    if not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised")
        return None, 1, 0
    pg = group if group is not None else dist.group.WORLD
    assert isinstance(pg, dist.ProcessGroup)
    size = dist.get_world_size(pg)
    return pg, size, dist.get_rank(pg) if group is not None else w.rank


def backend_of(group: Group) -> str:
    pg, size, _ = group_info(group)
    return "none" if pg is None or size == 1 else str(dist.get_backend(pg))


def _global(pg: dist.ProcessGroup, group: Group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(pg, rank)


def _check(name: str, backend: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"{name}: tensors are on different devices "
            f"({', '.join(sorted(map(str, devices)))}); move them to one device first"
        )
    if backend == "nccl" and any(t.device.type != "cuda" for t in tensors):
        raise ValueError(f"{name}: backend nccl needs CUDA tensors; move them to world().device")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(
            f"{name}: tensors have different dtypes ({dtypes}); cast them to one dtype")


def reraise(entry: CollectiveCall, exc: BaseException) -> NoReturn:
    """Raise ``exc`` from a call tracked as ``entry``, explained by the watchdog (which op,
    which call, which ranks are missing) where it can."""
    better = watchdog.failed(entry, exc)
    if better is exc:
        raise exc
    raise better from exc


def _enter(name: str, pg: dist.ProcessGroup, size: int, specs: Sequence[TensorSpec],
           reduce: str, root: int, on_device: bool = False) -> CollectiveCall:
    """Track the collective (watchdog) and, in debug mode, cross-check its fingerprint;
    refused at once where this rank runs alone (comm/alone.py)."""
    alone.refuse(f"metadist.comm.{name}")
    within = alone.current_call()  # named in progress reports: whichever rank reports
    entry = TRACKER.enter(name if within is None else f"{name} in {within}", pg, on_device)
    entry.within = within
    if TRACKER.debug:
        where = specs[0][0].device if specs else _world.world().device
        try:
            debug.check(entry, pg, size, dist.get_rank(), specs, reduce, root, where,
                        all_gather_single)
        except BaseException as exc:
            reraise(entry, exc)
    return entry


def _launch(name: str, group: Group, tensors: Sequence[torch.Tensor], nbytes: int,
            call: Callable[[dist.ProcessGroup], Any], async_op: bool, result: Any,
            finish: Callable[[], None] | None = None, *, agree: Sequence[TensorSpec] = (),
            reduce: str = "", root: int = -1, checked: bool = False) -> Handle | None:
    """Run ``call`` on the group, or return None when the group is a world of one.

    ``agree`` lists the tensors whose dtype (and shape) must be the same on every rank, with
    ``reduce`` and ``root``: what debug mode compares. ``checked``: the caller already ran
    :func:`_check` (before work of its own on the tensors).
    """
    pg, size, _ = group_info(group)
    if pg is None or size == 1:
        return None
    if not checked:
        _check(name, str(dist.get_backend(pg)), *tensors)
    on_device = bool(tensors) and tensors[0].device.type != "cpu"
    entry = _enter(name, pg, size, agree, reduce, root, on_device)
    stats.record(name, nbytes, size)
    try:
        work = call(pg)
    except BaseException as exc:
        reraise(entry, exc)
    works = work if isinstance(work, list) else ([work] if work is not None else [])
    handle = Handle(result, works, finish, entry)
    if async_op:
        TRACKER.release(entry)  # pending again once somebody waits on the handle
    else:
        handle.wait()
    return handle


def _blocking(name: str, pg: dist.ProcessGroup, size: int, call: Callable[[], Any]) -> Any:
    """Run a synchronous torch collective (object collectives) tracked like the others."""
    entry = _enter(name, pg, size, (), "", -1)
    try:
        out = call()
    except BaseException as exc:
        reraise(entry, exc)
    TRACKER.exit(entry)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _divider(tensor: torch.Tensor, size: int) -> Callable[[], None]:
    def finish() -> None:
        tensor.div_(size)

    return finish


def all_reduce(tensor: torch.Tensor, op: ReduceOpName = "sum", *, group: Group = None,
               async_op: bool = False) -> Handle:
    """Reduce ``tensor`` across the group, result on every rank (in place)."""
    top = _torch_op(op)
    _, size, _ = group_info(group)
    finish = _divider(tensor, size) if op == "mean" else None
    return _launch(
        "all_reduce", group, [tensor], _nbytes(tensor),
        lambda pg: dist.all_reduce(tensor, top, group=pg, async_op=True), async_op, tensor, finish,
        agree=[(tensor, True)], reduce=op,
    ) or Handle(tensor)


def broadcast(tensor: torch.Tensor, src: int = 0, *, group: Group = None,
              async_op: bool = False) -> Handle:
    """Copy ``tensor`` from group rank ``src`` to every rank (in place)."""
    return _launch(
        "broadcast", group, [tensor], _nbytes(tensor),
        lambda pg: dist.broadcast(tensor, _global(pg, group, src), group=pg, async_op=True),
        async_op, tensor, agree=[(tensor, True)], root=src,
    ) or Handle(tensor)


def reduce(tensor: torch.Tensor, dst: int = 0, op: ReduceOpName = "sum", *, group: Group = None,
           async_op: bool = False, impl: Impl = "auto") -> Handle:
    """Reduce onto group rank ``dst``; on other ranks ``tensor`` is left unspecified.

    On gloo ``impl="auto"`` sends straight to ``dst`` at two ranks (sums only) and otherwise
    runs an all-reduce, which gloo completes faster than its reduce (the contract allows it:
    other ranks' tensors are unspecified anyway).
    """
    top = _torch_op(op)
    pg, size, rank = group_info(group)
    finish = _divider(tensor, size) if op == "mean" and rank == dst else None
    gloo = pg is not None and size > 1 and impl == "auto" and str(dist.get_backend(pg)) == "gloo"
    if gloo and size == 2 and op in ("sum", "mean"):
        def call(pg: dist.ProcessGroup) -> Any:
            return ring.reduce_to(tensor, dst, pg, rank)
    elif gloo:
        def call(pg: dist.ProcessGroup) -> Any:
            return dist.all_reduce(tensor, top, group=pg, async_op=True)
    else:
        def call(pg: dist.ProcessGroup) -> Any:
            return dist.reduce(tensor, _global(pg, group, dst), top, group=pg, async_op=True)
    return _launch("reduce", group, [tensor], _nbytes(tensor), call, async_op, tensor,
                   finish, agree=[(tensor, True)], reduce=op, root=dst) or Handle(tensor)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: Group = None,
               async_op: bool = False, impl: Impl = "auto") -> Handle:
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (size N x input)."""
    pg, size, rank = group_info(group)
    if output.shape[0] != size * input.shape[0] or output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"all_gather: output shape {tuple(output.shape)} must be ({size}*{input.shape[0]}, "
            f"*{tuple(input.shape[1:])}) for input {tuple(input.shape)} in a group of {size}"
        )
    if pg is None or size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(output)
    _check("all_gather", str(dist.get_backend(pg)), output, input)  # before the copy below
    if impl == "auto" and str(dist.get_backend(pg)) == "gloo":
        chunks = ring.rows(output, size)
        if chunks[rank].data_ptr() != input.data_ptr():
            chunks[rank].copy_(input)
        if size == 2:  # one exchange
            def call(pg: dist.ProcessGroup) -> list[Any]:
                return [ring.all_gather(output, pg, size, rank)]
        else:
            def call(pg: dist.ProcessGroup) -> list[Any]:
                return [dist.broadcast(c, _global(pg, group, r), group=pg, async_op=True)
                        for r, c in enumerate(chunks)]
    else:
        def call(pg: dist.ProcessGroup) -> list[Any]:
            return [all_gather_single(output, input, group=pg, async_op=True)]
    return _launch("all_gather", group, [output, input], _nbytes(output), call, async_op,
                   output, agree=[(input, True)], checked=True) or Handle(output)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: ReduceOpName = "sum", *,
                   group: Group = None, async_op: bool = False, impl: Impl = "auto",
                   input_is_scratch: bool = False) -> Handle:
    """Reduce ``input`` across ranks and keep this rank's dim-0 chunk in ``output``.

    gloo's native reduce_scatter is an all-reduce plus copies; ``impl="auto"`` runs a ring of
    point-to-point sends instead (about twice as fast as an all-reduce), or for small inputs
    an in-place all-reduce. Both work in the input: ``input_is_scratch=True`` lets them
    overwrite it, otherwise it is copied first.
    """
    top = _torch_op(op)
    pg, size, rank = group_info(group)
    if input.shape[0] != size * output.shape[0] or output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"reduce_scatter: input shape {tuple(input.shape)} must be ({size}*{output.shape[0]},"
            f" *{tuple(output.shape[1:])}) for output {tuple(output.shape)} in a group of {size}"
        )
    if pg is None or size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(output)
    _check("reduce_scatter", str(dist.get_backend(pg)), output, input)  # before the clone
    scale = 1.0 / size if op == "mean" else None
    if impl == "auto" and str(dist.get_backend(pg)) == "gloo" and op in ("sum", "mean"):
        scratch = input if input_is_scratch else input.clone()
        mine = ring.rows(scratch, size)[rank]
        use_ring = _nbytes(input) >= RING_MIN_BYTES and input.is_contiguous()

        def finish() -> None:
            if not use_ring and mine.data_ptr() != output.data_ptr():
                output.copy_(mine)
            if scale is not None:
                output.mul_(scale)

        def call(pg: dist.ProcessGroup) -> list[Any]:
            if use_ring:
                return [ring.reduce_scatter(output, scratch, pg, size, rank)]
            return [dist.all_reduce(scratch, top, group=pg, async_op=True)]
    else:
        def finish() -> None:
            if scale is not None:
                output.mul_(scale)

        def call(pg: dist.ProcessGroup) -> list[Any]:
            return [_reduce_scatter_single(output, input, top, group=pg, async_op=True)]
    return _launch("reduce_scatter", group, [output, input], _nbytes(input), call, async_op,
                   output, finish, agree=[(output, True)], reduce=op,
                   checked=True) or Handle(output)


def reduce_scatter_parts(output: torch.Tensor, parts: Sequence[torch.Tensor],
                         op: ReduceOpName = "sum", *, group: Group = None,
                         async_op: bool = False) -> Handle:
    """:func:`reduce_scatter` of ``torch.cat(parts)`` (parts read flat, of the same sizes on
    every rank), reading the parts where they lie: a gradient that arrives as several tensors (a
    flat buffer's parameters) is reduced without first being copied into one. The parts are
    left as they were. On gloo the ring sends their slices; elsewhere they are concatenated
    for the native collective."""
    # A gradient arrives in whatever layout autograd made it (the gradient of a sum is an
    # expanded scalar): read each part flat, copied only where it is not already.
    parts = [p if p.dim() == 1 and p.is_contiguous() else p.reshape(-1).contiguous()
             for p in parts]
    pg, size, rank = group_info(group)
    total = sum(p.numel() for p in parts)
    if output.dim() != 1 or total != size * output.numel():
        raise ValueError(
            f"reduce_scatter_parts: parts of {total} elements in all must be {size} x the "
            f"1-D output's {output.numel()}")
    if pg is None or size == 1:
        for piece, at in zip(parts, itertools.accumulate((p.numel() for p in parts),
                                                         initial=0), strict=False):
            output.narrow(0, at, piece.numel()).copy_(piece)
        return Handle(output)
    use_ring = (str(dist.get_backend(pg)) == "gloo" and op in ("sum", "mean")
                and _nbytes(output) * size >= RING_MIN_BYTES)
    if not use_ring:
        return reduce_scatter(output, torch.cat(parts), op, group=group, async_op=async_op,
                              input_is_scratch=True)
    _check("reduce_scatter", "gloo", output, *parts)
    finish = _divider(output, size) if op == "mean" else None
    return _launch("reduce_scatter", group, [output, *parts], _nbytes(output) * size,
                   lambda pg: [ring.reduce_scatter_parts(output, parts, pg, size, rank)],
                   async_op, output, finish, agree=[(output, True)], reduce=op,
                   checked=True) or Handle(output)


def scatter(output: torch.Tensor, inputs: Sequence[torch.Tensor] | None = None, src: int = 0, *,
            group: Group = None, async_op: bool = False) -> Handle:
    """Send ``inputs[r]`` from group rank ``src`` into ``output`` on rank r."""
    pg, size, rank = group_info(group)
    if rank == src and (inputs is None or len(inputs) != size):
        raise ValueError(f"scatter: rank {src} (src) must pass a list of {size} tensors")
    if pg is None or size == 1:
        assert inputs is not None
        output.copy_(inputs[0])
        return Handle(output)
    send = list(inputs) if rank == src and inputs is not None else None
    return _launch(
        "scatter", group, [output, *(send or [])], _nbytes(output) * size,
        lambda pg: dist.scatter(output, send, _global(pg, group, src), group=pg, async_op=True),
        async_op, output, agree=[(output, True)], root=src,
    ) or Handle(output)


def gather(input: torch.Tensor, outputs: Sequence[torch.Tensor] | None = None, dst: int = 0, *,
           group: Group = None, async_op: bool = False) -> Handle:
    """Collect every rank's ``input`` into ``outputs`` (N tensors) on group rank ``dst``."""
    pg, size, rank = group_info(group)
    if rank == dst and (outputs is None or len(outputs) != size):
        raise ValueError(f"gather: rank {dst} (dst) must pass a list of {size} tensors")
    if pg is None or size == 1:
        assert outputs is not None
        outputs[0].copy_(input)
        return Handle(outputs)
    recv = list(outputs) if rank == dst and outputs is not None else None
    return _launch(
        "gather", group, [input, *(recv or [])], _nbytes(input) * size,
        lambda pg: dist.gather(input, recv, _global(pg, group, dst), group=pg, async_op=True),
        async_op, outputs, agree=[(input, True)], root=dst,
    ) or Handle(outputs)


def all_to_all(output: torch.Tensor, input: torch.Tensor,
               output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None, *, group: Group = None,
               async_op: bool = False) -> Handle:
    """Rank r sends dim-0 chunk s of ``input`` to rank s, receiving into chunk r of ``output``."""
    pg, size, _ = group_info(group)
    if pg is None or size == 1:
        output.copy_(input)
        return Handle(output)
    return _launch(
        "all_to_all", group, [output, input], _nbytes(input),
        lambda pg: dist.all_to_all_single(
            output, input, list(output_split_sizes) if output_split_sizes else None,
            list(input_split_sizes) if input_split_sizes else None, group=pg, async_op=True),
        # Split sizes may differ per rank; without them every rank moves equal chunks.
        async_op, output, agree=[(input, not (input_split_sizes or output_split_sizes))],
    ) or Handle(output)


def barrier(*, group: Group = None, async_op: bool = False) -> Handle:
    """Wait until every rank of the group has reached this call."""
    return _launch("barrier", group, [], 0, lambda pg: dist.barrier(group=pg, async_op=True),
                   async_op, None) or Handle(None)


def broadcast_object(obj: Any, src: int = 0, *, group: Group = None) -> Any:
    """Send a picklable object from group rank ``src``; every rank returns it."""
    pg, size, _ = group_info(group)
    if pg is None or size == 1:
        return obj
    box = [obj]
    _blocking("broadcast_object", pg, size,
              lambda: dist.broadcast_object_list(box, src=_global(pg, group, src), group=pg))
    return box[0]


def gather_object(obj: Any, dst: int = 0, *, group: Group = None) -> list[Any] | None:
    """Every rank's picklable ``obj`` on group rank ``dst`` (``None`` elsewhere)."""
    pg, size, rank = group_info(group)
    if pg is None or size == 1:
        return [obj]
    out: list[Any] | None = [None] * size if rank == dst else None
    _blocking("gather_object", pg, size,
              lambda: dist.gather_object(obj, out, dst=_global(pg, group, dst), group=pg))
    return out


def all_gather_object(obj: Any, *, group: Group = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order."""
    pg, size, _ = group_info(group)
    if pg is None or size == 1:
        return [obj]
    out: list[Any] = [None] * size
    _blocking("all_gather_object", pg, size, lambda: dist.all_gather_object(out, obj, group=pg))
    return out
