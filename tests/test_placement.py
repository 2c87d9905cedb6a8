"""The layout each strategy describes (strategies/placement.py) is the truth: assembling every
tensor of the model and of the optimizer state from all ranks' described parts, each element
from exactly one writer, gives the plain model's state dict and the single-process
optimizer's state after the same training."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import metadist
from metadist.strategies.optimizer_state import cut_state, gather_state
from metadist.strategies.placement import (
    ModulePlacement,
    OptimizerPlacement,
    Part,
    Placement,
    flat_part,
    held,
    numbered_groups,
    optimizer_placement,
    paste,
    per_element,
)
from metadist.strategies.tensors.shard_piece import shard_internals
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

OPTIONS: dict[str, dict[str, Any]] = {"zero3": {"min_unit_params": 30},
                                      "hsdp": {"min_unit_params": 30}}
STEPS = 3


class Net(nn.Module):
    """Uneven sizes (world 3 splits flats and owners unevenly), tied weights, a 0-dim
    parameter, persistent buffers (one 0-dim) and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.mid = nn.Linear(7, 7)
        self.out = nn.Linear(7, 5)
        self.tied = nn.Linear(7, 5, bias=False)
        self.tied.weight = self.out.weight
        self.scale = nn.Parameter(torch.tensor(1.25))
        self.register_buffer("shift", torch.linspace(0, 1, 7))
        self.register_buffer("count", torch.tensor(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h = (self.inp(x) + self.shift).tanh()
        h = self.mid(h).tanh()
        return (self.out(h) + self.tied(h)) * self.scale


def _optimizer(net: nn.Module) -> torch.optim.Optimizer:
    mid = [p for n, p in net.named_parameters() if n.startswith("mid")]
    rest = [p for n, p in net.named_parameters() if not n.startswith("mid")]
    return torch.optim.Adam([{"params": mid, "lr": 0.01}, {"params": rest, "lr": 0.02}])


def _batch(step: int) -> Tensor:
    return torch.randn(12, 5, generator=torch.Generator().manual_seed(step))


def _reference() -> tuple[dict[str, Tensor], dict[str, Any]]:
    torch.manual_seed(0)
    net = Net()
    opt = _optimizer(net)
    for step in range(STEPS):
        opt.zero_grad()
        net(_batch(step)).pow(2).mean().backward()
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}, opt.state_dict()


Pieces = dict[str, list[tuple[int, int, Tensor]]]


def _written(p: Placement, rank: int) -> list[tuple[int, int, Tensor]]:
    """What ``rank`` writes of ``p``: for tensors every rank holds whole, rank 0's copy."""
    writes = {"spread": rank == 0, "rank0": rank == 0, "holder": True, "none": False}
    return [(q.start, q.stop, held(q).clone()) for q in p.parts] if writes[p.writer] else []


def _module_pieces(where: ModulePlacement, rank: int) -> dict[str, Any]:
    pieces: Pieces = {p.name: _written(p, rank) for p in where.tensors}
    shapes = {p.name: p.shape for p in where.tensors}
    return {"pieces": pieces, "shapes": shapes, "keys": list(where.keys),
            "aliases": dict(where.aliases), "ignorable": sorted(where.ignorable),
            "values": {k: v.detach().clone() if isinstance(v, Tensor) else v
                       for k, v in where.values.items()} if rank == 0 else {}}


def _optimizer_pieces(where: OptimizerPlacement, opt: torch.optim.Optimizer,
                      rank: int) -> dict[str, Any]:
    pieces: Pieces = {}
    values: dict[str, Any] = {}
    for s in where.stepped:
        state = opt.state.get(s.tensor, {})
        for p in s.params:
            for name, value in state.items():
                key = f"{p.name}/{name}"
                if per_element(name, value, s.tensor.shape):
                    pieces[key] = _written(p.on(value), rank)
                elif s.lead:
                    values[key] = value.clone() if isinstance(value, Tensor) else value
    return {"pieces": pieces, "values": values, "shapes": list(where.shapes),
            "counts": list(where.counts)}


def _train(strategy: str) -> dict[str, Any]:
    s = metadist.strategy(strategy, **OPTIONS.get(strategy, {}))
    w = s.world
    torch.manual_seed(0)
    net = Net()
    model, opt = s.setup(net, _optimizer(net))
    for step in range(STEPS):
        opt.zero_grad()
        s.backward(model(_batch(step).chunk(w.world_size)[w.rank]).pow(2).mean())
        opt.step()
    where = optimizer_placement(opt)
    gathered = gather_state(where, opt, None)  # consolidated from the description alone
    assert gathered is not None
    # ... and cut back into this rank's tensors, it is the live state again
    cut, own = cut_state(where.stepped, gathered)
    live = {id(t): opt.state[t] for t in cut}
    with shard_internals():  # zero3's state is of shards: compared whole, as cut
        recut = not any(own.values()) and all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(live[id(t)][k]))
            for t, entry in cut.items() for k, v in entry.items())
    return {"module": _module_pieces(model.placements(), w.rank),
            "optimizer": _optimizer_pieces(where, opt, w.rank), "gathered": gathered,
            "recut": recut and len(cut) == sum(1 for x in where.stepped if opt.state.get(x.tensor))}


def _on_ranks(strategies: list[str]) -> dict[str, Any]:
    return {name: _train(name) for name in strategies}


def _assemble(key: str, shape: tuple[int, ...], per_rank: list[Pieces]) -> Tensor:
    n = math.prod(shape)
    covered = torch.zeros(n, dtype=torch.long)
    out: Tensor | None = None
    for pieces in per_rank:
        for start, stop, data in pieces.get(key, []):
            if out is None:
                out = torch.zeros(n, dtype=data.dtype)
            out[start:stop] = data
            covered[start:stop] += 1
    assert out is not None, f"{key}: no rank writes it"
    assert bool((covered == 1).all()), f"{key}: elements written {covered.tolist()} times"
    return out.view(shape)


def _check(results: list[dict[str, Any]], where: str) -> None:
    plain, plain_opt = _reference()
    module = [r["module"] for r in results]
    first = module[0]
    assert sorted(first["keys"]) == sorted(plain), where
    assert first["ignorable"] == ["scratch"], where
    got: dict[str, Tensor] = {}
    for key in plain:
        stored = first["aliases"].get(key, key)
        got[key] = (torch.as_tensor(first["values"][key]) if key in first["values"] else
                    _assemble(stored, first["shapes"][stored], [m["pieces"] for m in module]))
    assert_tensors_close(got, plain, where=f"{where} module")
    optim = [r["optimizer"] for r in results]
    params = [p for g in plain_opt["param_groups"] for p in g["params"]]
    assert optim[0]["counts"] == [len(g["params"]) for g in plain_opt["param_groups"]]
    assert [tuple(s) for s in optim[0]["shapes"]] == [tuple(plain[n].shape) for n in _names()]
    values: dict[str, Any] = {}
    for o in optim:
        assert not values.keys() & o["values"].keys(), f"{where}: a value written twice"
        values.update(o["values"])
    got, want = {}, {}
    for i, pid in enumerate(params):
        for name, value in plain_opt["state"][pid].items():
            key = want_key = f"{i}/{name}"
            want[want_key] = torch.as_tensor(value)
            got[key] = (torch.as_tensor(values[key]) if name == "step" else
                        _assemble(key, tuple(value.shape), [o["pieces"] for o in optim]))
    assert_tensors_close(got, want, where=f"{where} optimizer")
    for r in results:
        assert r["recut"], f"{where}: the cut state differs from the live state"
        gathered = {f"{i}/{name}": torch.as_tensor(v)
                    for i, entry in r["gathered"].items() for name, v in entry.items()}
        assert_tensors_close(gathered, want, where=f"{where} gathered")


def _names() -> list[str]:
    """State-dict names of the optimizer's parameters, in its plain order."""
    names = [n for n, _ in Net().named_parameters()]
    return [n for n in names if n.startswith("mid")] + [n for n in names
                                                         if not n.startswith("mid")]


CELLS = [(1, 1, ["single", "zero3"]), (4, 2, ["hsdp"]),
         (3, 1, ["ddp", "zero1", "zero2", "zero3"])]


@pytest.mark.parametrize(("world", "nodes", "strategies"), CELLS,
                         ids=[f"x{w}-{'-'.join(s)}" for w, _, s in CELLS])
def test_assembling_the_described_parts_gives_the_plain_state(
        world: int, nodes: int, strategies: list[str]) -> None:
    ranks = run_on_ranks(_on_ranks, world, args=(strategies,), nnodes=nodes, timeout=120)
    for name in strategies:
        _check([r[name] for r in ranks], f"{name} x{world}")


def test_flat_part_cuts_each_range_once() -> None:
    local = torch.zeros(4)
    # a tensor of 6 elements at offset 3 of a flat buffer, shards of 4 starting at 0, 4, 8
    got = [flat_part(local, lo, 3, 6) for lo in (0, 4, 8)]
    assert [[(p.start, p.stop, p.offset) for p in parts] for parts in got] == [
        [(0, 1, 3)], [(1, 5, 0)], [(5, 6, 0)]]
    assert [len(flat_part(local, lo, 5, 0)) for lo in (0, 4)] == [1, 0]  # empty: shard 0
    part = got[1][0]
    paste(part, torch.arange(1.0, 5.0))
    assert local.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert held(Part(2, 4, local, 1)).tolist() == [2.0, 3.0]


def test_per_element_state_and_numbered_groups() -> None:
    assert per_element("exp_avg", torch.zeros(3, 2), (3, 2))
    assert not per_element("step", torch.zeros(3, 2), (3, 2))
    assert not per_element("exp_avg", torch.zeros(6), (3, 2))
    assert not per_element("momentum", 0.9, (3, 2))
    groups = numbered_groups([{"params": [9, 8], "lr": 1}, {"params": [7], "lr": 2}], [2, 1])
    assert groups == [{"lr": 1, "params": [0, 1]}, {"lr": 2, "params": [2]}]


def _move_scalar_parameter(path: str) -> list[bool]:
    """Save under one strategy, load under another: a 0-dim parameter is a value where every
    rank holds it whole and a tensor where zero3 shards it; each side must read the other."""
    out = []
    for saver, loader, fmt in (("zero3", "zero3", "full"), ("ddp", "zero3", "sharded"),
                               ("zero3", "ddp", "sharded")):
        torch.manual_seed(0)
        saved = metadist.strategy(saver, **OPTIONS.get(saver, {})).setup_module(Net())
        s = metadist.strategy(loader, **OPTIONS.get(loader, {}))
        target = f"{path}/{saver}-{loader}-{fmt}"
        s.save(target, {"model": saved}, format=fmt)
        torch.manual_seed(1)
        loaded = s.setup_module(Net())
        s.load(target, {"model": loaded})
        want, got = saved.state_dict(), loaded.state_dict()
        out.append(all(torch.equal(got[k], v) for k, v in want.items()))
    return out


def test_a_scalar_parameter_moves_between_layouts(tmp_path: Any) -> None:
    assert run_on_ranks(_move_scalar_parameter, 2, args=(str(tmp_path),), timeout=120) == [
        [True, True, True]] * 2
