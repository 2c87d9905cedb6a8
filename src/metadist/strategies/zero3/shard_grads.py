"""zero3/hsdp: ``torch.autograd.grad`` with respect to the shards, refused unless asked for.

The gradient with respect to a flat shard (or a parameter's slice of it) is this rank's
slice of the gradient averaged over ranks: another objective than the gradient of this
rank's loss that ddp and one process give. The unshard's backward (flat.py, sharded_fast.py)
refuses it when no backward accumulates into the shard, except inside
:func:`reduced_shard_grads`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# A process-wide count, not a context variable: autograd may run a backward on a device thread.
_reduced_shard_grads = 0


@contextmanager
def reduced_shard_grads() -> Iterator[None]:
    """Opt in: inside, ``torch.autograd.grad`` with respect to flat shards returns this rank's
    slice of the gradient averaged over ranks (a collective), not an error."""
    global _reduced_shard_grads
    _reduced_shard_grads += 1
    try:
        yield
    finally:
        _reduced_shard_grads -= 1


def shard_grads_allowed() -> bool:
    """Inside :func:`reduced_shard_grads`."""
    return _reduced_shard_grads > 0


def refuse_shard_grad() -> None:
    raise RuntimeError(
        "torch.autograd.grad with respect to the model's parameters under zero3/fsdp/hsdp: "
        "this rank holds a slice of each, and their gradient would be this rank's slice of the "
        "gradient averaged over all ranks, not the gradient of this rank's loss that ddp and "
        "one process give (a gradient penalty written this way optimises another objective). "
        "Differentiate with respect to the full parameters instead: params = "
        "model.full_parameters(); loss = loss_fn(model.functional_forward(params, x), y); "
        "grads = torch.autograd.grad(loss, list(params.values()), create_graph=True) (wrap "
        "it in strategy.sync_grads(...) for the gradient of the global loss). To get the "
        "reduced slice on purpose, call it inside `with model.reduced_shard_grads():`")
