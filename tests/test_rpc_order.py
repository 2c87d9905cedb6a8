"""The rpc engine adds the gradients a map's calls send back into one shared tensor in call
order, not in the order they arrive (issue 27, item 5).

torch's distributed autograd sums the gradients that come back to the driver for a tensor
sent to several calls as they arrive, so float32 rounding followed the workers' timing: the
same program gave different gradients run to run. Here each call's backward sleeps a
different time (its place in a permutation that changes from trial to trial), and the calls
return gradients of very different magnitude, so most arrival orders round differently.

Observed before the fix (rank 0 adding, in arrival order, what calls on itself and on rank 1
send back): for the 4 permutations the module's gradient was -1.797, 1.0, 1.003 and -1.797
(call order: -1.797), and in the third trial the remote reference's gradient was -1.5.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import metadist
import metadist.mapreduce as todist
from metadist.meta import module_clone

# Per call: the factor of its gradient (float32: 1e8 + 1 rounds to 1e8) and its partner terms.
SCALES = (1.0, 1e8, -1e8, 0.7, 3e-3, -2.5)
DELAY_S = 0.04  # per place in the permutation: arrivals 40 ms apart
TRIALS = ((0, 1, 2, 3, 4, 5), (5, 4, 3, 2, 1, 0), (2, 0, 4, 1, 5, 3), (1, 2, 0, 5, 3, 4))


class _Late(torch.autograd.Function):
    """Identity whose backward sleeps first: the call's gradient leaves late."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, delay: float) -> torch.Tensor:
        ctx.delay = delay
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.delay)
        return grad, None


def call(net: nn.Module, w: torch.Tensor, ref: Any, scale: float, delay: float
         ) -> torch.Tensor:
    """One call: the shared module, the shared loose tensor and the shared module behind a
    remote reference, each scaled by the call's factor, the gradient released late."""
    remote = ref.to_here()
    total = (net.weight.sum() + w.sum() + remote.weight.sum()) * scale
    return _Late.apply(total, delay)


def _calls(net: nn.Module, w: torch.Tensor, ref: Any, delays: list[float]
           ) -> list[tuple[int, tuple[Any, ...], dict[str, Any]]]:
    """Every call gets the same net, w and ref; calls alternate between the two ranks."""
    return [(i % 2, (net, w, ref, s, d), {}) for i, (s, d) in enumerate(zip(SCALES, delays,
                                                                             strict=True))]


def _grads_over_trials() -> list[list[list[float]]] | None:
    todist.init("rpc")
    try:
        if not todist.is_driver():
            return None
        out = []
        for order in TRIALS:
            delays = [DELAY_S * place for place in order]
            net = nn.Linear(1, 3, bias=False)
            w = torch.zeros(3, requires_grad=True)
            remote_net = nn.Linear(1, 3, bias=False)
            # A copy whose weight is in the graph (a pickled Parameter arrives detached), as
            # TorchOpt's distributed example sends its network.
            ref = todist.rpc.RRef(module_clone(remote_net, by="copy"))
            params = [net.weight, w, remote_net.weight]
            with todist.autograd.context() as ctx:
                losses = todist.remote_sync_call(call, args=(net, w, ref, delays),
                                                 partitioner=_calls)
                grads = todist.autograd.grad(ctx, torch.stack(losses).sum(), params)
            out.append([g.flatten().tolist() for g in grads])
        return out
    finally:
        todist.shutdown()


def test_shared_gradients_are_summed_in_call_order_whatever_the_arrival_order() -> None:
    # Fresh processes: in pooled ones that already ran test_mapreduce's RPC session, torch's
    # RRef bookkeeping keeps a fork of this test's remote reference unconfirmed ("Leaking
    # RRef"), and the graceful shutdown waits out the job's limit (100 s) before it returns.
    trials = metadist.launch(_grads_over_trials, 2, timeout=180, threads=1)[0]
    in_call_order = torch.zeros((), dtype=torch.float32)
    for s in SCALES:
        in_call_order = in_call_order + torch.tensor(s, dtype=torch.float32)
    expected = [in_call_order.item()] * 3
    for order, grads in zip(TRIALS, trials, strict=True):
        assert grads == [expected] * 3, f"arrival order {order}: {grads} != {expected}"
