"""Parity harness: train on N ranks through a strategy and on one plain PyTorch process on the
same global batches; compare parameters, buffers and optimizer state.

Protocol: same seeded model; global batch split into N contiguous equal
slices; the reference is one process on the whole batch with a mean loss; fp32 after >= 10
steps within rtol 1.3e-6 / atol 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import metadist
from metadist.testing import assert_same_on_all_ranks

RTOL, ATOL = 1.3e-6, 1e-5
SHARDED_GRADS = ("zero2", "zero3", "hsdp")
GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4 and, per rank, by 2 micro-batches up to N=3
STEPS = 10
FEATURES, HIDDEN, OUT = 10, 16, 3


class Net(nn.Module):
    """Linear -> tanh -> BatchNorm (buffers) -> Linear, plus a branch forward never uses.

    (BatchNorm right after a Linear would make that Linear's bias gradient exactly zero in
    theory, and Adam would then amplify rounding noise into parameter-sized steps.)
    """

    def __init__(self, batchnorm: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN) if batchnorm else nn.Identity()
        self.out = nn.Linear(HIDDEN, OUT)
        self.unused = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.inp(x))))


def make_net(batchnorm: bool = True, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(batchnorm)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    match name:
        case "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        case "adam":
            return torch.optim.Adam(params, lr=1e-2)
        case "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def batches(steps: int = STEPS, global_batch: int = GLOBAL_BATCH,
            seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, FEATURES, generator=g),
             torch.randn(global_batch, OUT, generator=g)) for _ in range(steps)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def local_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the first global batch."""
    w = metadist.world()
    x, y = batches(1)[0]
    return shard(x, w.rank, w.world_size), shard(y, w.rank, w.world_size)


def micro(t: torch.Tensor, accumulate: int) -> list[torch.Tensor]:
    return list(t.chunk(accumulate))


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer,
             strategy: metadist.Strategy | None = None,
             names: list[str] | None = None) -> dict[str, Any]:
    """Parameters, buffers and (full, consolidated) optimizer state by name, detached copies.

    With a strategy, ``model`` is the wrapped module (its ``state_dict()`` is the user's
    module's, gathered if sharded) and ``names`` the parameter names in optimizer order.
    """
    if strategy is None:
        names = [n for n, _ in model.named_parameters()]
        ids = {id(p): n for n, p in model.named_parameters()}
        by_name = {ids[id(p)]: optimizer.state[p] for g in optimizer.param_groups
                   for p in g["params"] if optimizer.state.get(p)}
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        grads_none: list[str] | None = sorted(n for n, p in model.named_parameters()
                                              if p.grad is None)
    else:
        assert names is not None
        consolidated = strategy.optimizer_state_dict(optimizer)
        assert consolidated is not None
        ordered = [pid for g in consolidated["param_groups"] for pid in g["params"]]
        by_name = {names[i]: consolidated["state"][pid] for i, pid in enumerate(ordered)
                   if pid in consolidated["state"]}
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # Strategies that shard gradients drop the ones a rank does not own: not comparable.
        grads_none = None if strategy.name in SHARDED_GRADS else sorted(
            n for n, p in model.module.named_parameters() if p.grad is None)
    state = {f"{n}.{k}": v.detach().clone() for n, entry in by_name.items()
             for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0}
    return {"params": {n: full[n] for n in names},
            "buffers": {n: v for n, v in full.items() if n not in names},
            "state": state, "grads_none": grads_none}


def reference(optimizer: str, accumulate: int = 1, batchnorm: bool = True,
              data: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
              world: int = 1) -> dict[str, Any]:
    """Plain single-process training on the whole global batch.

    With accumulation, micro-batch j of the global batch is the concatenation of every
    rank's micro-batch j (what the ranks see together), so BatchNorm sees the same batches.
    """
    net = make_net(batchnorm)
    opt = make_optimizer(optimizer, net.parameters())
    for x, y in data or batches():
        opt.zero_grad()
        parts_x = [micro(shard(x, r, world), accumulate) for r in range(world)]
        parts_y = [micro(shard(y, r, world), accumulate) for r in range(world)]
        for j in range(accumulate):
            xj = torch.cat([p[j] for p in parts_x])
            yj = torch.cat([p[j] for p in parts_y])
            (loss_fn(net(xj), yj) / accumulate).backward()
        opt.step()
    return snapshot(net, opt)


def train_on_rank(strategy: str, optimizer: str, accumulate: int = 1, batchnorm: bool = True,
                  options: dict[str, Any] | None = None,
                  check_each_step: Callable[[nn.Module], None] | None = None) -> dict[str, Any]:
    """The same training through ``metadist.strategy(strategy)`` on this rank's slices."""
    w = metadist.world()
    net = make_net(batchnorm)
    opts = dict(options or {})
    if batchnorm:
        opts.setdefault("sync_batchnorm", True)
    s = metadist.strategy(strategy, **opts)
    names = [n for n, _ in net.named_parameters()]
    model, opt = s.setup(net, make_optimizer(optimizer, net.parameters()))
    for x, y in batches():
        opt.zero_grad()
        xs = micro(shard(x, w.rank, w.world_size).to(s.device), accumulate)
        ys = micro(shard(y, w.rank, w.world_size).to(s.device), accumulate)
        for j in range(accumulate):
            if j < accumulate - 1:
                with s.no_sync(model):
                    (loss_fn(model(xs[j]), ys[j]) / accumulate).backward()
            else:
                s.backward(loss_fn(model(xs[j]), ys[j]) / accumulate)
        opt.step()
        for name, b in model.module.named_buffers():
            assert_same_on_all_ranks(b, f"buffer {name}")
        if check_each_step is not None:
            check_each_step(model)
    return snapshot(model, opt, s, names)


def assert_tensors_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         where: str = "") -> None:
    """The same names, and every tensor within the parity tolerances."""
    assert got.keys() == want.keys(), f"{where}: names differ"
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


def assert_parity(got: dict[str, Any], want: dict[str, Any], where: str = "") -> None:
    for kind in ("params", "buffers", "state"):
        assert got[kind].keys() == want[kind].keys(), f"{where} {kind} names differ"
        for name, value in want[kind].items():
            torch.testing.assert_close(
                got[kind][name], value, rtol=RTOL, atol=ATOL,
                msg=lambda m, kind=kind, name=name: f"{where} {kind} {name}: {m}")
    if got["grads_none"] is not None:
        assert got["grads_none"] == want["grads_none"], f"{where} grad None sets differ"
