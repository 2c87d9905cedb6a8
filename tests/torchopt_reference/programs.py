"""TorchOpt-style programs, runnable on TorchOpt 0.7.3 itself and on
metadist.compat.torchopt, so the two can be compared case by case (tests/
test_torchopt_compat.py runs both, TorchOpt from .peers/).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _api(impl: str) -> Any:
    return importlib.import_module("torchopt" if impl == "torchopt" else
                                   "metadist.compat.torchopt")


def _conv_net() -> nn.Module:
    torch.manual_seed(1)
    # No bias before BatchNorm: its gradient is zero in exact arithmetic, so its value would
    # be rounding noise that the meta-steps amplify differently on every CPU.
    return nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(),
                         nn.Linear(4 * 26 * 26, 5)).double()


def _mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _maml(torchopt: Any, make: Callable[[nn.Module], Any], net: nn.Module, x: torch.Tensor,
          y: torch.Tensor, xq: torch.Tensor) -> dict[str, torch.Tensor]:
    """Three meta-steps of two inner steps each, the net restored between tasks."""
    meta_opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(3):
        inner = make(net)
        state = torchopt.extract_state_dict(net, by="reference", detach_buffers=True)
        for _ in range(2):
            inner.step(F.cross_entropy(net(x), y))
        loss = F.cross_entropy(net(xq), y)
        meta_opt.zero_grad()
        loss.backward()
        meta_opt.step()
        torchopt.recover_state_dict(net, state)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


CASES = ("MetaSGD", "MetaAdam", "MetaAdamW", "MetaRMSProp", "MetaAdaGrad", "sgd_positional",
         "apply_updates_default", "original_running_mean", "FuncOptimizer", "chain_clip",
         "schedule", "MetaAdam_accelerated", "MetaAdamW_accelerated", "adam_accelerated_float32")
#: computed with TorchOpt's own operations in TorchOpt's order (its fused Adam and
#: hand-written backward), so equal bit for bit
BITWISE = ("MetaAdam_accelerated", "MetaAdamW_accelerated", "adam_accelerated_float32")


def _accelerated_float32(torchopt: Any) -> list[torch.Tensor]:
    """A meta-gradient through three differentiable accelerated Adam steps, in float32:
    with respect to per-element loss weights (a hyperparameter) and the start point."""
    start = torch.linspace(-1.0, 1.0, 7, requires_grad=True)
    weights = torch.linspace(0.5, 1.5, 7, requires_grad=True)
    target = torch.linspace(1.0, -0.5, 7)
    opt = torchopt.adam(0.1, moment_requires_grad=True, use_accelerated_op=True)
    params = (start,)
    state = opt.init(params)
    for _ in range(3):
        loss = ((params[0] - target) ** 2 * weights).sum()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        updates, state = opt.update(grads, state, inplace=False)
        params = torchopt.apply_updates(params, updates, inplace=False)
    meta = torch.autograd.grad((params[0] ** 3).sum(), (weights, start))
    return [params[0].detach(), *meta]


def run(impl: str) -> dict[str, Any]:
    torchopt = _api(impl)
    g = torch.Generator().manual_seed(0)
    img, img_q = (torch.randn(10, 1, 28, 28, generator=g, dtype=torch.float64)
                  for _ in range(2))
    vec, vec_q = (torch.randn(12, 6, generator=g, dtype=torch.float64) for _ in range(2))
    labels5, labels3 = torch.arange(10) % 5, torch.arange(12) % 3
    out: dict[str, Any] = {}
    # positional arguments in TorchOpt's order: MetaSGD(module, lr, momentum, weight_decay)
    out["MetaSGD"] = _maml(torchopt, lambda n: torchopt.MetaSGD(n, 0.1, 0.9, 0.01), _conv_net(),
                           img, labels5, img_q)
    for name, make in [("MetaAdam", lambda n: torchopt.MetaAdam(n, 0.01)),
                       ("MetaAdamW", lambda n: torchopt.MetaAdamW(n, 0.01)),
                       ("MetaRMSProp", lambda n: torchopt.MetaRMSProp(n, 0.01, 0.9, 1e-8, 0.0,
                                                                      0.5, True)),
                       ("MetaAdaGrad", lambda n: torchopt.MetaAdaGrad(n, 0.1))]:
        out[name] = _maml(torchopt, make, _mlp(), vec, labels3, vec_q)
    # sgd(lr, momentum, dampening, weight_decay): the 4th positional is weight_decay
    p = (torch.ones(3, dtype=torch.float64, requires_grad=True),)
    opt = torchopt.sgd(0.1, 0.9, 0.0, 0.5)
    state = opt.init(p)
    for _ in range(3):
        updates, state = opt.update((2 * p[0],), state, params=p, inplace=False)
        p = torchopt.apply_updates(p, updates, inplace=False)
    out["sgd_positional"] = p[0].detach().clone()
    # apply_updates is in place by default
    q = (torch.zeros(2, dtype=torch.float64),)
    torchopt.apply_updates(q, (torch.ones(2, dtype=torch.float64),))
    out["apply_updates_default"] = q[0].clone()
    # detach_buffers: the clone's BatchNorm statistics live in storage of their own
    net = _conv_net()
    torchopt.module_clone(net, by="reference", detach_buffers=True)(img)
    out["original_running_mean"] = net[1].running_mean.clone()
    # FuncOptimizer, chain with clipping, an lr schedule
    net = _mlp()
    names = [n for n, _ in net.named_parameters()]
    params = tuple(net.parameters())
    func = torchopt.FuncOptimizer(torchopt.adam(0.01))
    for _ in range(3):
        logits = torch.func.functional_call(net, dict(zip(names, params, strict=True)), (vec,))
        params = func.step(F.cross_entropy(logits, labels3), params)
    out["FuncOptimizer"] = [t.detach().clone() for t in params]
    chained = torchopt.chain(torchopt.clip_grad_norm(0.5), torchopt.sgd(0.1))
    p = (torch.ones(3, dtype=torch.float64),)
    updates, _ = chained.update((torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64),),
                                chained.init(p), params=p, inplace=False)
    out["chain_clip"] = updates[0].clone()
    scheduled = torchopt.sgd(lambda count: 0.1 * 0.5 ** count)
    p = (torch.ones(3, dtype=torch.float64),)
    state = scheduled.init(p)
    for _ in range(3):
        updates, state = scheduled.update((torch.ones(3, dtype=torch.float64),), state,
                                          params=p, inplace=False)
        p = torchopt.apply_updates(p, updates, inplace=False)
    out["schedule"] = p[0].clone()
    for name, make in [
            ("MetaAdam_accelerated", lambda n: torchopt.MetaAdam(n, 0.01,
                                                                  use_accelerated_op=True)),
            ("MetaAdamW_accelerated", lambda n: torchopt.MetaAdamW(n, 0.01,
                                                                    use_accelerated_op=True))]:
        out[name] = _maml(torchopt, make, _mlp(), vec, labels3, vec_q)
    out["adam_accelerated_float32"] = _accelerated_float32(torchopt)
    assert tuple(out) == CASES
    return out
