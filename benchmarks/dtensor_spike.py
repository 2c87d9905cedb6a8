"""Spike: zero3's shards as torch DTensors, against today's flat engine and FSDP2.

    python -m benchmarks.dtensor_spike [--world 2] [--steps 10] [--warmup 2]
                                       [--workloads mlp,transformer,maml] [--json PATH] [--quick]

The question it answers: can metadist hold zero3/hsdp parameters as DTensors (the user's
names and global shapes, placement carried by the tensor) without a price in time or memory?
Two DTensor layouts, each a few lines over torch's DTensor (SimpleFSDP's pattern: a unit's
pre-forward hook gathers with ``redistribute([Replicate()]).to_local(grad_placements=
[Partial()])``, whose backward reduce-scatters; the step is torch's optimizer on DTensors):

* *per parameter*: every parameter a ``Shard(0)`` DTensor (FSDP2's surface): one all-gather
  and one reduce-scatter per parameter;
* *flat per unit*: one ``Shard(0)`` DTensor per unit holding its parameters flattened,
  gathered once, parameters bound as views of the gathered buffer (today's flat storage,
  with placement carried by the tensor).

Beside them in the same processes, taking turns step by step (medians, warm-up discarded):
metadist zero3 (units of the same modules) and torch FSDP2 ``fully_shard``; the losses of all
configurations are compared (they train from the same weights on the same batches). Memory:
bytes of the unique storages of parameters, gradients and Adam's state after a step (a
DTensor counts its local shard). ``maml``: second-order MAML (per-rank tasks, 3 inner steps)
on the per-parameter DTensors and on zero3's ``full_parameters()``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import metadist
from benchmarks.common import Results, alternate, output_args, parse
from benchmarks.models import workload, zero3_unit_params
from metadist.testing import unique_storage_bytes

_GATHER = ([Replicate()], [Partial()])  # placements of a gather, and of its gradient


class DTensorUnits:
    """A model's units with parameters held as DTensor ``Shard(0)``: per parameter or one
    flat DTensor per unit; each unit gathered before its members' forward, released after."""

    def __init__(self, model: nn.Module, units: list[nn.Module], mesh: Any, flat: bool) -> None:
        self.mesh, self.flat = mesh, flat
        owned: dict[int, tuple[nn.Module, list[tuple[nn.Module, str]]]] = {}
        seen: set[int] = set()
        for unit in [*units, model]:  # the innermost unit owns a parameter; the root the rest
            slots = []
            for owner in unit.modules():
                for attr, p in owner._parameters.items():
                    if p is not None and id(p) not in seen:
                        seen.add(id(p))
                        slots.append((owner, attr))
            owned[id(unit)] = (unit, slots)
        self.params: list[nn.Parameter] = []
        for unit, slots in owned.values():
            if slots:
                self._shard(unit, slots)

    def _shard(self, unit: nn.Module, slots: list[tuple[nn.Module, str]]) -> None:
        tensors = [owner._parameters[attr] for owner, attr in slots]
        if self.flat:
            n = self.mesh.size()
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            flat = F.pad(flat, (0, -flat.numel() % n))
            shard = nn.Parameter(distribute_tensor(flat, self.mesh, [Shard(0)]))
            self.params.append(shard)
            shapes = [t.shape for t in tensors]
            for owner, attr in slots:
                del owner._parameters[attr]

            def gather(module: nn.Module, args: Any) -> None:
                full = shard.redistribute(self.mesh, _GATHER[0]).to_local(
                    grad_placements=_GATHER[1])
                at = 0
                for (owner, attr), shape in zip(slots, shapes, strict=True):
                    size = shape.numel()
                    owner._parameters[attr] = full[at:at + size].view(shape)
                    at += size

            def release(module: nn.Module, args: Any, out: Any) -> None:
                for owner, attr in slots:
                    owner._parameters.pop(attr, None)
        else:
            shards = []
            for (owner, attr), t in zip(slots, tensors, strict=True):
                shard = nn.Parameter(distribute_tensor(t.detach(), self.mesh, [Shard(0)]))
                owner._parameters[attr] = shard
                shards.append(shard)
            self.params += shards

            def gather(module: nn.Module, args: Any) -> None:
                for (owner, attr), shard in zip(slots, shards, strict=True):
                    owner._parameters[attr] = shard.redistribute(
                        self.mesh, _GATHER[0]).to_local(grad_placements=_GATHER[1])

            def release(module: nn.Module, args: Any, out: Any) -> None:
                for (owner, attr), shard in zip(slots, shards, strict=True):
                    owner._parameters[attr] = shard
        unit.register_forward_pre_hook(gather)
        unit.register_forward_hook(release)


def _units(model: nn.Module, name: str) -> list[nn.Module]:
    kind = nn.Linear if name == "mlp" else nn.TransformerEncoderLayer
    return [m for m in model.modules() if isinstance(m, kind)]


Step = Callable[[], float]


def _configs(name: str, quick: bool) -> tuple[dict[str, Step], dict[str, Callable[[], int]]]:
    """One training step per configuration (its loss), and each one's per-rank bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w = metadist.world()
    factory, data, loss_fn = workload(name, quick)
    batches = data(w.rank)
    mesh = init_device_mesh("cpu", (w.world_size,))
    steps: dict[str, Step] = {}
    sizes: dict[str, Callable[[], int]] = {}

    def add(label: str, model: nn.Module, params: list[Any], scale: float,
            backward: Callable[[Tensor], None]) -> None:
        opt = torch.optim.Adam(params, lr=1e-4)
        at = [0]

        def step() -> float:
            x, y = batches[at[0] % len(batches)]
            at[0] += 1
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            backward(loss * scale)
            opt.step()
            return float(loss.detach())

        def size() -> int:
            state = [v for s in opt.state.values() for v in s.values()
                     if isinstance(v, Tensor) and v.dim() > 0]
            return unique_storage_bytes([*params, *(p.grad for p in params), *state])

        steps[label], sizes[label] = step, size

    model = factory()
    options: dict[str, Any] = ({"min_unit_params": zero3_unit_params(quick)} if name == "mlp"
                               else {"wrap_classes": (nn.TransformerEncoderLayer,)})
    s = metadist.strategy("zero3", **options)
    wrapped = s.setup_module(model)
    add("metadist zero3 (flat engine)", wrapped, list(wrapped.parameters()), 1.0, s.backward)
    for flat in (False, True):
        model = factory()
        units = DTensorUnits(model, _units(model, name), mesh, flat)
        add(f"DTensor {'flat per unit' if flat else 'per parameter'}", model, units.params,
            1.0 / w.world_size, lambda t: t.backward())
    model = factory()
    for m in _units(model, name):
        fully_shard(m)
    fully_shard(model)
    add("torch FSDP2 fully_shard", model, list(model.parameters()), 1.0,
        lambda t: t.backward())
    return steps, sizes


def _maml_configs(quick: bool) -> dict[str, Step]:
    """Second-order MAML, per-rank tasks: per-parameter DTensor gathers and zero3."""
    from torch.distributed.device_mesh import init_device_mesh

    w = metadist.world()
    d, h = (16, 32) if quick else (128, 512)

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(),
                             nn.Linear(h, 1))

    g = torch.Generator().manual_seed(1 + w.rank)
    tasks = [(torch.randn(16, d, generator=g), torch.randn(16, 1, generator=g))
             for _ in range(2)]

    def meta(forward: Callable[[dict[str, Tensor], Tensor], Tensor],
             start: Callable[[], dict[str, Tensor]]) -> Tensor:
        total = torch.zeros(())
        for x, y in tasks:
            fast = start()
            for _ in range(3):
                grads = torch.autograd.grad(F.mse_loss(forward(fast, x), y),
                                            list(fast.values()), create_graph=True)
                fast = {n: p - 0.05 * gr for (n, p), gr in zip(fast.items(), grads,
                                                               strict=True)}
            total = total + F.mse_loss(forward(fast, x), y)
        return total / len(tasks)

    mesh = init_device_mesh("cpu", (w.world_size,))
    plain = net()
    shards = {n: nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
              for n, p in plain.named_parameters()}
    dopt = torch.optim.SGD(list(shards.values()), lr=0.01)

    def dtensor_step() -> float:
        dopt.zero_grad()
        loss = meta(lambda p, x: torch.func.functional_call(plain, p, (x,)), lambda: {
            n: t.redistribute(mesh, _GATHER[0]).to_local(grad_placements=_GATHER[1])
            for n, t in shards.items()})
        (loss / w.world_size).backward()
        dopt.step()
        return float(loss.detach())

    s = metadist.strategy("zero3", wrap_classes=(nn.Linear,))
    m = net()
    model, opt = s.setup(m, torch.optim.SGD(m.parameters(), lr=0.01))

    def zero3_step() -> float:
        opt.zero_grad()
        loss = meta(model.functional_forward, model.full_parameters)
        s.backward(loss)
        opt.step()
        return float(loss.detach())

    return {"metadist zero3 full_parameters()": zero3_step,
            "DTensor per parameter": dtensor_step}


def _body(name: str, steps: int, warmup: int, quick: bool) -> dict[str, Any]:
    losses: dict[str, list[float]] = {}
    if name == "maml":
        configs, sizes = _maml_configs(quick), {}
    else:
        configs, sizes = _configs(name, quick)

    def timed(label: str) -> Callable[[], None]:
        return lambda: losses.setdefault(label, []).append(configs[label]())

    ms = alternate({label: timed(label) for label in configs}, steps, warmup)
    first = next(iter(losses.values()))
    return {"ms": {k: v * 1e3 for k, v in ms.items()},
            "bytes": {k: size() for k, size in sizes.items()},
            "loss_diff": {k: max(abs(a - b) for a, b in zip(v, first, strict=True))
                          for k, v in losses.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workloads", default="mlp,transformer,maml")
    output_args(ap)
    args = parse(ap, steps=2, warmup=1)
    with Results("dtensor_spike", args) as results:
        for name in args.workloads.split(","):
            r = metadist.launch(_body, args.world, args=(name, args.steps, args.warmup,
                                                         args.quick), threads=1,
                                timeout=3000)[0]
            base = next(iter(r["ms"].values()))
            results.heading(f"{name}, {args.world} ranks (gloo, a thread each): ms per step, "
                            f"medians of {args.steps}, taking turns")
            rows = [[label, f"{ms:.1f}", f"{ms / base:.2f}",
                     f"{r['bytes'][label] / 2**20:.1f}" if label in r["bytes"] else "-",
                     f"{r['loss_diff'][label]:.1e}"] for label, ms in r["ms"].items()]
            results.table(["configuration", "ms / step", "/ metadist", "P+G+O MiB per rank",
                           "max |loss - metadist's|"], rows, key=name)
            results.data[name] = r


if __name__ == "__main__":
    main()
