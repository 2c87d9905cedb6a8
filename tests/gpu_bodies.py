"""Rank bodies of tests/test_gpu.py, parametrised by the device they must compute on.

test_gpu.py runs them with ``kind="cuda"``; each also runs with ``kind="cpu"`` on ranks
without a GPU, so their logic is checked on every machine before a GPU ever sees it (the
GPU tests themselves skip there). Results come back on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import fast_meta
import metadist
from meta import INNER_LR, INNER_STEPS, META_STEPS, sinusoid_net, sinusoid_tasks
from metadist.testing import bytes_kept_by
from parity import loss_fn, make_net, make_optimizer, snapshot, train_on_rank


def on(kind: str) -> torch.device:
    """This rank's device, checked to be ``kind``; TF32 off (float32 parity needs it)."""
    dev = metadist.world().device
    assert dev.type == kind, f"the rank computes on {dev}, expected {kind}"
    if kind == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dev


def cpu(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU (what a rank returns)."""
    if isinstance(tree, dict):
        return {k: cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(cpu(v) for v in tree)
    return tree.detach().cpu() if torch.is_tensor(tree) else tree


def parity(kind: str, strategy: str, options: dict[str, Any],
           batchnorm: bool = True) -> dict[str, Any]:
    """tests/parity.py's training through ``strategy`` on this rank's device."""
    on(kind)
    return dict(cpu(train_on_rank(strategy, "adam", 1, batchnorm, options)))


def dp_refusal(kind: str) -> str:
    """What ``dp`` says when it cannot drive two GPUs (it needs two)."""
    on(kind)
    try:
        metadist.strategy("dp").setup_module(nn.Linear(2, 2))
    except ValueError as err:
        return str(err)
    return "no error"


def overflow(kind: str) -> dict[str, Any]:
    """16-mixed under ddp: step 1's loss is made infinite, so its gradients overflow; the
    scaler must skip that step (parameters untouched), back off, and step again after."""
    dev = on(kind)
    net = make_net(batchnorm=False)
    s = metadist.strategy("ddp", precision="16-mixed")
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    x, y = torch.randn(8, 10, device=dev), torch.randn(8, 3, device=dev)
    skipped, moved, scales = [], [], []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        scales.append(s.scaler.scale_value)
        opt.zero_grad()
        out = model(x)
        if step == 1:
            out = out * float("inf")
        s.backward(loss_fn(out, y))
        opt.step()
        skipped.append(s.scaler.last_step_skipped)
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                                 strict=True)))
    return {"skipped": skipped, "moved": moved, "scales": scales,
            "after": s.scaler.scale_value, "devices": {p.device.type for p in model.parameters()}}


def bf16_true(kind: str, strategy: str) -> dict[str, Any]:
    """bf16-true: parameters, gradients and optimizer state in bfloat16, and it trains."""
    dev = on(kind)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    s = metadist.strategy(strategy, precision="bf16-true")
    model, opt = s.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x = torch.randn(32, 64, device=dev)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = model(x).float().square().mean()
        s.backward(loss)
        opt.step()
        losses.append(loss.item())
    state = [v for st in opt.state.values() for v in st.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return {"params": {p.dtype for p in model.parameters()},
            "state": {v.dtype for v in state}, "devices": {v.device.type for v in state},
            "ratio": losses[-1] / losses[0]}


class Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)], nn.Linear(64, 1))


def checkpointing(kind: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Four steps with and without activation checkpointing (second order through one inner
    step, as MAML); the states after, and what one forward leaves allocated."""
    dev = on(kind)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 64, generator=g).to(dev), torch.randn(32, 1, generator=g).to(dev))
            for _ in range(4)]
    out: dict[str, Any] = {}
    for label, extra in (("plain", {}), ("checkpointed", {"activation_checkpointing": Block})):
        s = metadist.strategy(strategy, **options, **extra)
        net = _blocks()
        model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
        for x, y in data:
            opt.zero_grad()
            params = model.full_parameters()
            inner = ((model.functional_forward(params, x) - y) ** 2).mean()
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            fast = {n: p - 0.1 * gr for (n, p), gr in zip(params.items(), grads, strict=True)}
            s.backward(((model.functional_forward(fast, x) - y) ** 2).mean())
            opt.step()
        # storages counted as the forward allocates them, on either device
        loss, held = bytes_kept_by(lambda model=model: model(data[0][0]).square().mean())
        s.backward(loss)
        out[label] = {"state": cpu(dict(model.state_dict())), "held": held}
    return out


def maml(kind: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Second-order MAML (tests/meta.py's: 12 sine tasks, 5 inner steps, 10 meta-steps,
    Adam) through ``strategy`` and as plain torch on the same device, this rank's share of
    the tasks; both parameter sets."""
    dev = on(kind)
    w = metadist.world()
    per = len(sinusoid_tasks(0)) // w.world_size

    def run(forward: Any, params: Callable[[], dict[str, torch.Tensor]],
            backward: Callable[[torch.Tensor], None], opt: torch.optim.Optimizer,
            tasks: Callable[[int], list[tuple[torch.Tensor, ...]]]) -> None:
        for step in range(META_STEPS):
            opt.zero_grad()
            total = torch.zeros((), device=dev)
            mine = tasks(step)
            for xs, ys, xq, yq in mine:
                fast = params()
                for _ in range(INNER_STEPS):
                    inner = ((forward(fast, xs) - ys) ** 2).mean()
                    grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
                    fast = {n: p - INNER_LR * gr
                            for (n, p), gr in zip(fast.items(), grads, strict=True)}
                total = total + ((forward(fast, xq) - yq) ** 2).mean() / len(mine)
            backward(total)
            opt.step()

    def on_dev(tasks: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(t.to(dev) for t in task) for task in tasks]

    plain = sinusoid_net().to(dev)
    run(lambda p, x: functional_call(plain, p, (x,)), lambda: dict(plain.named_parameters()),
        lambda t: t.backward(), torch.optim.Adam(plain.parameters(), lr=1e-3),
        lambda step: on_dev(sinusoid_tasks(step)))
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net := sinusoid_net(), torch.optim.Adam(net.parameters(), lr=1e-3))
    run(model.functional_forward, model.full_parameters, s.backward, opt,
        lambda step: on_dev(sinusoid_tasks(step)[w.rank * per:(w.rank + 1) * per]))
    return {"plain": cpu(dict(plain.named_parameters())),
            "strategy": cpu(dict(model.full_parameters()))}


def fast_maml(kind: str, strategy: str, options: dict[str, Any], update: str = "sgd"
              ) -> dict[str, Any]:
    """Cooperative second-order MAML through ``model.fast_weights()`` (tests/fast_meta.py:
    shard fast weights under zero3, each unit gathered on this device) and one process's
    plain torch on the whole batch on the same device; both parameter sets."""
    dev = on(kind)
    return {"plain": cpu(fast_meta.reference(update=update, device=dev)),
            "strategy": cpu(fast_meta.on_rank(strategy, options, update=update))}


def deferred(kind: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """A model built under ``metadist.deferred_init()`` and materialised by ``setup`` on
    this rank's device, against the same model built eagerly: where it lives, its first
    values and its values after three steps."""
    dev = on(kind)
    out: dict[str, Any] = {}
    for label in ("eager", "deferred"):
        torch.manual_seed(0)
        if label == "deferred":
            with metadist.deferred_init():
                net = _blocks()
        else:
            net = _blocks()
        s = metadist.strategy(strategy, **options)
        model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
        first = cpu(dict(model.state_dict()))
        devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).to(dev)
        for _ in range(3):
            opt.zero_grad()
            s.backward(model(x).square().mean())
            opt.step()
        out[label] = {"first": first, "final": cpu(dict(model.state_dict())),
                      "devices": devices}
    return out


def compiled(kind: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile(backend="inductor")`` of the set-up model against plain torch
    compiled the same way on the same device: parameters after 5 steps, graph breaks, and
    whether anything compiled again after the first step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    dev = on(kind)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 64, generator=g).to(dev), torch.randn(16, 1, generator=g).to(dev))
            for _ in range(5)]
    out: dict[str, Any] = {}
    for label in ("plain", "strategy"):
        torch._dynamo.reset()
        counters.clear()
        net = _blocks().to(dev)
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        wrapped: nn.Module = net
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
        if label == "strategy":
            s = metadist.strategy(strategy, **options)
            wrapped, opt = s.setup(net, opt)
            backward = s.backward
        model = torch.compile(wrapped, backend="inductor")  # its state_dict has _orig_mod.
        graphs = []
        for x, y in data:
            opt.zero_grad()
            backward(((model(x) - y) ** 2).mean())
            opt.step()
            graphs.append(counters["stats"]["unique_graphs"])
        out[label] = {"params": cpu(dict(net.named_parameters()) if label == "plain"
                                    else dict(wrapped.state_dict())),
                      "breaks": sum(counters["graph_break"].values()), "graphs": graphs}
    return out


def save_trained(kind: str, strategy: str, options: dict[str, Any], path: str,
                 steps: int) -> dict[str, Any]:
    """Train ``steps`` of tests/parity.py's training on this device, save (sharded)."""
    dev = on(kind)
    s = metadist.strategy(strategy, **options)
    net = make_net(batchnorm=False)
    names = [n for n, _ in net.named_parameters()]
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    _steps(s, model, opt, dev, range(steps))
    s.save(path, {"model": model, "optimizer": opt, "step": steps})
    return dict(cpu(snapshot(model, opt, s, names)))


def load_train_save(kind: str, strategy: str, options: dict[str, Any], source: str,
                    target: str | None, steps: int) -> dict[str, Any]:
    """Load ``source`` on this device (another seed first: the load must overwrite it),
    snapshot, train ``steps`` more, save to ``target``; the loaded and the final state."""
    dev = on(kind)
    s = metadist.strategy(strategy, **options)
    net = make_net(batchnorm=False, seed=7)
    names = [n for n, _ in net.named_parameters()]
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    s.load(source, state)
    loaded = cpu(snapshot(model, opt, s, names))
    done = int(state["step"])
    _steps(s, model, opt, dev, range(done, done + steps))
    if target:
        s.save(target, {"model": model, "optimizer": opt, "step": done + steps})
    return {"loaded": loaded, "final": cpu(snapshot(model, opt, s, names)),
            "devices": {p.device.type for p in model.parameters()}}


def _steps(s: metadist.Strategy, model: nn.Module, opt: torch.optim.Optimizer,
           dev: torch.device, which: range) -> None:
    """tests/parity.py's batches ``which`` (this rank's slice) on ``dev``."""
    from parity import batches, shard

    w = metadist.world()
    data = batches(max(which.stop, 1))
    for i in which:
        x, y = data[i]
        opt.zero_grad()
        s.backward(loss_fn(model(shard(x, w.rank, w.world_size).to(dev)),
                           shard(y, w.rank, w.world_size).to(dev)))
        opt.step()
