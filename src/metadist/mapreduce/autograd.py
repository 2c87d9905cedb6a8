"""Distributed autograd helpers that one script can use under either engine.

Under rpc they wrap torch's distributed autograd: gradients of a backward live in its
context until :func:`backward` adds them into ``.grad`` (under a lock: RPC callbacks run on
other threads). Under spmd a context is a plain counter, and backward/grad are torch's
own autograd (the spmd engine's collectives are ordinary autograd functions).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence

import torch

from metadist.errors import MetadistError
from metadist.mapreduce import rpc
from metadist.mapreduce.session import ensure_started

Tensors = torch.Tensor | Sequence[torch.Tensor]

_lock = threading.Lock()
_spent: set[int] = set()  # rpc contexts whose gradients were already handed out
_local_ids = itertools.count(1)


def is_available() -> bool:
    """Whether torch's distributed autograd (needed by the rpc engine) is built in."""
    if not rpc.AVAILABLE:
        return False
    import torch.distributed.autograd as dist_autograd

    return bool(dist_autograd.is_available())


def _rpc_engine() -> bool:
    return ensure_started().engine == "rpc"


@contextlib.contextmanager
def context() -> Iterator[int]:
    """``with context() as ctx_id:`` around a forward and its backward; yields the id."""
    if not _rpc_engine():
        yield next(_local_ids)
        return
    import torch.distributed.autograd as dist_autograd

    with dist_autograd.context() as ctx_id:
        try:
            yield int(ctx_id)
        finally:
            with _lock:
                _spent.discard(int(ctx_id))


def _as_list(tensors: Tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _spend(ctx_id: int) -> None:
    with _lock:
        if ctx_id in _spent:
            raise MetadistError(
                f"distributed autograd context {ctx_id} already ran a backward; its gradients "
                "add up across backward calls, so a second one would count the first twice. "
                "Open a new `with autograd.context()` for each backward or grad")
        _spent.add(ctx_id)


def _dist_backward(ctx_id: int, roots: list[torch.Tensor],
                   retain_graph: bool) -> dict[torch.Tensor, torch.Tensor]:
    import torch.distributed.autograd as dist_autograd

    _spend(ctx_id)
    # torch builds these from C++ and does not re-export them for type checkers.
    dist_autograd.backward(ctx_id, roots, retain_graph=retain_graph)  # type: ignore[attr-defined]
    grads: dict[torch.Tensor, torch.Tensor] = dist_autograd.get_gradients(  # type: ignore[attr-defined]
        ctx_id)
    return grads


def backward(autograd_ctx_id: int, tensors: Tensors, retain_graph: bool = False,
             inputs: Tensors | None = None) -> None:
    """Backpropagate ``tensors`` (summed) and accumulate into ``.grad`` of the graph's leaves
    (only of ``inputs`` when given), on whichever ranks hold them."""
    roots = _as_list(tensors)
    wanted = _as_list(inputs) if inputs is not None else None
    if wanted is not None:
        if not wanted:
            raise ValueError("backward(inputs=[]) names no tensor; pass None to accumulate "
                             "into every leaf, or the tensors whose .grad you want")
        if not all(t.requires_grad for t in wanted):
            raise ValueError("backward(inputs=...): every input must require grad")
    if not _rpc_engine():
        torch.autograd.backward(roots, retain_graph=retain_graph, inputs=wanted)
        return
    grads = _dist_backward(autograd_ctx_id, roots, retain_graph)
    if wanted is not None:
        keep = {id(t) for t in wanted}
        grads = {t: g for t, g in grads.items() if id(t) in keep}
    with _lock:
        for t, g in grads.items():
            t.grad = g if t.grad is None else t.grad + g


def grad(autograd_ctx_id: int, outputs: Tensors, inputs: Tensors, retain_graph: bool = False,
         allow_unused: bool = False, create_graph: bool = False) -> tuple[torch.Tensor | None,
                                                                          ...]:
    """Gradients of ``outputs`` (summed) with respect to ``inputs``, returned, not
    accumulated. ``create_graph`` (higher-order gradients) needs the spmd engine."""
    roots, wanted = _as_list(outputs), _as_list(inputs)
    if not all(t.requires_grad for t in wanted):
        raise ValueError("grad(inputs=...): every input must require grad")
    if not _rpc_engine():
        return torch.autograd.grad(roots, wanted, retain_graph=retain_graph,
                                   create_graph=create_graph, allow_unused=allow_unused)
    if create_graph:
        raise MetadistError("torch's distributed autograd cannot record its backward "
                            "(create_graph=True); use the spmd engine for higher-order "
                            "gradients across ranks")
    grads = _dist_backward(autograd_ctx_id, roots, retain_graph)
    by_id = {id(t): g for t, g in grads.items()}
    out: list[torch.Tensor | None] = []
    for i, t in enumerate(wanted):
        if id(t) not in by_id and not allow_unused:
            raise ValueError(f"grad: input {i} was not used to compute the outputs; pass "
                             "allow_unused=True to get None for it")
        out.append(by_id.get(id(t)))
    return tuple(out)


def get_gradients(autograd_ctx_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients held by a distributed autograd context (rpc engine)."""
    if not _rpc_engine():
        raise MetadistError("get_gradients reads a distributed autograd context, which only "
                            "the rpc engine has; under spmd, backward() accumulates into "
                            ".grad and grad() returns the gradients")
    import torch.distributed.autograd as dist_autograd

    grads: dict[torch.Tensor, torch.Tensor] = dist_autograd.get_gradients(  # type: ignore[attr-defined]
        autograd_ctx_id)
    return grads


__all__ = ["backward", "context", "get_gradients", "grad", "is_available"]
