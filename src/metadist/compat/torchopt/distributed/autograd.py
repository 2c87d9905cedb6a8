"""``torchopt.distributed.autograd`` on metadist: distributed autograd contexts, backward and
grad with TorchOpt's signatures, over :mod:`metadist.mapreduce.autograd`.

Under rpc (this layer's default) they are torch's distributed autograd; :func:`backward`
also adds the gradients into ``.grad``. Under spmd a context is a plain id and backward/grad
are torch's own autograd. One difference from TorchOpt on purpose: a second backward or grad
in one context raises, because the context's gradients would add up and count the first
backward twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from metadist.compat.torchopt.distributed import _session
from metadist.mapreduce import autograd as mr_autograd

TensorOrTensors = torch.Tensor | Sequence[torch.Tensor]


def is_available() -> bool:
    """Whether torch's distributed autograd (needed by the rpc engine) is built in."""
    return mr_autograd.is_available()


DistAutogradContext: Any = None
if is_available():
    import torch.distributed.autograd as _dist_autograd

    # torch builds it in C++ and does not re-export it for type checkers.
    DistAutogradContext = _dist_autograd.DistAutogradContext  # type: ignore[attr-defined]


@contextlib.contextmanager
def context() -> Iterator[int]:
    """``with context() as context_id:`` around a forward and its backward; yields the id."""
    _session.start()
    with mr_autograd.context() as context_id:
        yield context_id


def backward(autograd_ctx_id: int, tensors: TensorOrTensors, retain_graph: bool = False,
             inputs: TensorOrTensors | None = None) -> None:
    """Backpropagate ``tensors`` (summed) and add the gradients into ``.grad`` of the graph's
    leaves (only of ``inputs`` when given) on whichever ranks hold them."""
    _session.start()
    mr_autograd.backward(autograd_ctx_id, tensors, retain_graph=retain_graph, inputs=inputs)


def grad(autograd_ctx_id: int, outputs: TensorOrTensors, inputs: TensorOrTensors,
         retain_graph: bool = False, allow_unused: bool = False) -> tuple[torch.Tensor | None,
                                                                          ...]:
    """Gradients of ``outputs`` (summed) with respect to ``inputs``, returned and not added
    into ``.grad``; ``None`` for an unused input when ``allow_unused``."""
    _session.start()
    return mr_autograd.grad(autograd_ctx_id, outputs, inputs, retain_graph=retain_graph,
                            allow_unused=allow_unused)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients the distributed autograd context holds for this rank's tensors."""
    _session.start()
    return mr_autograd.get_gradients(context_id)


__all__ = ["DistAutogradContext", "backward", "context", "get_gradients", "grad",
           "is_available"]
