"""The collectives as a program calls them, with the habits of torch and RAF programs.

* Each returns its result: the tensor it worked on in place (``x = comm.all_reduce(x)``;
  ``all_gather``/``reduce_scatter``/``scatter``/``all_to_all`` their output, ``gather`` its
  outputs), or a :class:`~metadist.comm.handle.Handle` only when asked with
  ``async_op=True`` (as torch returns a work only then), whose ``wait()`` gives the result.
* ``all_reduce``, ``broadcast`` and ``reduce`` take a list or tuple of tensors as well:
  fused into one collective per dtype and size cap (comm/fused.py), the list returned.
* ``send``/``recv`` (``isend``/``irecv``: a handle) between two ranks of a group, watched by
  the same bounded waits as the collectives (runtime/watchdog.py), counted apart from the
  group's collectives (the other ranks take no part), and in debug mode preceded by an
  exchange of fingerprints (dtype and shape) both sides compare, so a mismatch stops both,
  named, instead of reading garbage or waiting.

metadist's own code calls ``comm.ops`` (a handle always); these are the program's entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from metadist.comm import fused, ops, stats
from metadist.comm.handle import Handle
from metadist.errors import CollectiveMismatchError
from metadist.runtime.tracker import TRACKER
from metadist.runtime.world import Group

Tensors = torch.Tensor | Sequence[torch.Tensor]


def _result(handle: Handle, async_op: bool) -> Any:
    return handle if async_op else handle.wait()


def _listed(tensor: Tensors) -> list[torch.Tensor] | None:
    if isinstance(tensor, torch.Tensor):
        return None
    if isinstance(tensor, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in tensor):
        return list(tensor)
    raise TypeError(f"expected a tensor or a list/tuple of tensors, got {type(tensor).__name__}")


def _returning(collective: Callable[..., Handle]) -> Callable[..., Any]:
    """``collective`` returning its result, or its handle when called with ``async_op=True``."""
    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        return _result(collective(*args, **kwargs), kwargs.get("async_op", False))

    return call


def _fusing(single: Callable[..., Handle], listed: Callable[..., Handle]) -> Callable[..., Any]:
    """``single`` on a tensor, ``listed`` (fused) on a list or tuple of tensors; returning
    the result, or the handle when called with ``async_op=True``."""
    @functools.wraps(single)
    def call(tensor: Tensors, *args: Any, **kwargs: Any) -> Any:
        many = _listed(tensor)
        handle = single(tensor, *args, **kwargs) if many is None else listed(many, *args,
                                                                             **kwargs)
        return _result(handle, kwargs.get("async_op", False))

    return call


#: Reduce a tensor (or every tensor of a list, fused) across the group, in place.
all_reduce = _fusing(ops.all_reduce, fused.fused_all_reduce)
#: Copy a tensor (or every tensor of a list, fused) from group rank ``src``.
broadcast = _fusing(ops.broadcast, fused.fused_broadcast)
#: Reduce onto group rank ``dst`` (every tensor of a list, fused).
reduce = _fusing(ops.reduce, fused.fused_reduce)
all_gather = _returning(ops.all_gather)
reduce_scatter = _returning(ops.reduce_scatter)
scatter = _returning(ops.scatter)
gather = _returning(ops.gather)
all_to_all = _returning(ops.all_to_all)


# ----- point to point ----------------------------------------------------------------------
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)
_HEADER = 2 + 8  # dtype code, ndim, up to 8 dims


def _header(t: torch.Tensor) -> torch.Tensor:
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
    dims = list(t.shape)[:8]
    values = [code, t.dim(), *dims, *[-1] * (8 - len(dims))]
    return torch.tensor(values, dtype=torch.int64, device=t.device)


def _describe(header: list[int]) -> str:
    dtype = _DTYPES[header[0]] if header[0] < len(_DTYPES) else "another dtype"
    return f"{dtype} of shape {tuple(header[2:2 + header[1]])}"


def _p2p(name: str, tensor: torch.Tensor, peer: int, group: Group, async_op: bool) -> Handle:
    pg, size, rank = ops.group_info(group)
    if pg is None or size == 1:
        raise ValueError(f"{name}: a world (or group) of one rank has no peer to {name} with; "
                         "run with two or more ranks")
    if not 0 <= peer < size or peer == rank:
        raise ValueError(f"{name}: peer {peer} is not another rank of the group (ranks 0-"
                         f"{size - 1}, this one {rank})")
    target = peer if group is None else dist.get_global_rank(pg, peer)
    me = dist.get_rank()
    sending = name in ("send", "isend")
    entry = TRACKER.enter_p2p(name, me, target, tensor.device.type != "cpu")
    stats.record(name, tensor.numel() * tensor.element_size(), 2)
    try:
        if TRACKER.debug:  # both sides compare what is sent with what is received into
            mine, theirs = _header(tensor), torch.empty(_HEADER, dtype=torch.int64,
                                                        device=tensor.device)
            for step in ((mine, theirs) if sending else (theirs, mine)):
                (dist.send if step is mine else dist.recv)(step, target, group=pg)
            if not torch.equal(theirs, mine):
                sent, into = (mine, theirs) if sending else (theirs, mine)
                raise CollectiveMismatchError(
                    f"{name} {'to' if sending else 'from'} rank {target}: the sender sends a "
                    f"{_describe(sent.tolist())}, the receiver receives into a "
                    f"{_describe(into.tolist())}; receive into a tensor of the sent dtype and "
                    "shape")
        call = dist.isend if sending else dist.irecv
        work = call(tensor, target, group=pg)
    except BaseException as exc:
        ops.reraise(entry, exc)
    handle = Handle(tensor, [work], None, entry)
    if async_op:
        TRACKER.release(entry)
    else:
        handle.wait()
    return handle


def send(tensor: torch.Tensor, dst: int, *, group: Group = None) -> torch.Tensor:
    """Send ``tensor`` to group rank ``dst``; returns once it is sent."""
    result: torch.Tensor = _p2p("send", tensor, dst, group, False).wait()
    return result


def recv(tensor: torch.Tensor, src: int, *, group: Group = None) -> torch.Tensor:
    """Receive into ``tensor`` from group rank ``src``; returns it, filled."""
    result: torch.Tensor = _p2p("recv", tensor, src, group, False).wait()
    return result


def isend(tensor: torch.Tensor, dst: int, *, group: Group = None) -> Handle:
    """:func:`send` started: a handle to wait on (before ``tensor`` is changed)."""
    return _p2p("isend", tensor, dst, group, True)


def irecv(tensor: torch.Tensor, src: int, *, group: Group = None) -> Handle:
    """:func:`recv` started: a handle whose ``wait()`` gives ``tensor``, filled."""
    return _p2p("irecv", tensor, src, group, True)
