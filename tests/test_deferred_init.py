"""Deferred initialisation: a model built under ``metadist.deferred_init()`` is materialised
by setup with exactly the values eager construction gives (same seed), under every strategy;
zero3/hsdp allocate one unit at a time (each rank keeps only its shards); the generator after
the block is where eager construction leaves it; misuse says what to do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.testing import peak_bytes_of, run_on_ranks
from parity import assert_tensors_close

WIDTH, BLOCKS, STEPS, BATCH = 48, 8, 10, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("steps", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)  # its init fills a row view
        self.body = nn.Sequential(nn.Linear(8, WIDTH), *[Block() for _ in range(BLOCKS)],
                                  nn.Linear(WIDTH, 3))
        self.register_buffer("offset", torch.randn(3))  # a buffer drawn from the generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[0]) % 10
        return self.body(x + self.emb(ids)) + self.offset


def _net() -> nn.Module:
    return Net()


OPTIONS: dict[str, dict[str, Any]] = {"zero3": {"wrap_classes": (Block,)},
                                      "hsdp": {"wrap_classes": (Block,)}}


def _build(deferred: bool, seed: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    if deferred:
        with metadist.deferred_init():
            model = _net()
    else:
        model = _net()
    return model, torch.rand(4)  # where the generator is after construction


def _train(name: str, deferred: bool, seed: int = 0) -> dict[str, Any]:
    strategy = metadist.strategy(name, **OPTIONS.get(name, {}))
    model, after = _build(deferred, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # built on the meta model
    model, optimizer = strategy.setup(model, optimizer)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    world = strategy.world
    data = torch.Generator().manual_seed(7)
    share = BATCH // world.world_size
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 8, generator=data), torch.randn(BATCH, 3, generator=data)
        rows = slice(world.rank * share, (world.rank + 1) * share)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        optimizer.zero_grad()
        strategy.backward(loss)
        optimizer.step()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"after": after, "init": init, "final": final}


def _compare(names: list[str], seed_by_rank: bool = False) -> list[str]:
    """Each strategy, eager against deferred, on these ranks; what differed."""
    seed = metadist.world().rank if seed_by_rank else 0
    rank0 = _build(False, 0)[0].state_dict()  # what rank 0 constructs
    problems = []
    for name in names:
        eager, deferred = _train(name, False, seed), _train(name, True, seed)
        if not torch.equal(eager["after"], deferred["after"]):
            problems.append(f"{name}: the generator after the block differs from eager")
        for key, want in eager["init"].items():
            if not torch.equal(deferred["init"][key], want):
                problems.append(f"{name}: initial {key} differs from eager construction")
            # every rank starts from rank 0's values (seed 0), whatever seed each drew with
            if not torch.equal(deferred["init"][key], rank0[key]):
                problems.append(f"{name}: initial {key} differs from rank 0's construction")
        try:
            assert_tensors_close(deferred["final"], eager["final"], where=name)
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


def test_every_strategy_starts_and_trains_exactly_as_eager_construction() -> None:
    assert _compare(["single"]) == []  # one process, here
    for problems in run_on_ranks(_compare, 2, args=(["ddp", "zero1", "zero2", "zero3"],)):
        assert problems == []
    for problems in run_on_ranks(_compare, 3, args=(["zero3"],)):  # uneven shards
        assert problems == []
    for problems in run_on_ranks(_compare, 4, args=(["hsdp"],), nnodes=2):
        assert problems == []


def test_ranks_seeded_differently_start_from_rank_zeros_values_as_eager_setup_does() -> None:
    for problems in run_on_ranks(_compare, 2, args=(["zero3", "ddp"], True)):
        assert problems == []


def _setup_peak(deferred: bool) -> tuple[int, int]:
    strategy = metadist.strategy("zero3", wrap_classes=(Block,))

    def build_and_setup() -> nn.Module:
        model, _ = _build(deferred, 0)
        return strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))[0]

    model, peak = peak_bytes_of(build_and_setup)
    full = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    return peak, full


def test_zero3_materialises_one_unit_at_a_time() -> None:
    (deferred, full), (eager, _) = run_on_ranks(_setup_peak, 2, args=(True,))[0], \
        run_on_ranks(_setup_peak, 2, args=(False,))[0]
    unit = 2 * WIDTH * WIDTH * 4  # the largest unit, in bytes (a block, rounded up)
    assert eager >= full  # eager construction holds the whole model first
    # Half the model (this rank's shards) plus one unit being flattened and its copy.
    assert deferred < full / 2 + 3 * unit, (deferred, full)


def test_a_plain_meta_model_is_refused_naming_deferred_init() -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"metadist\.deferred_init\(\)"):
        metadist.strategy("single").setup_module(model)


def test_a_tensor_replaced_outside_the_block_is_refused() -> None:
    with metadist.deferred_init():
        model = nn.Linear(3, 3)
    model = model.double()  # on meta tensors, outside the log: no values to replay
    with pytest.raises(ValueError, match=r"converted outside it .* convert it inside the block"):
        metadist.strategy("single").setup_module(model)


def test_an_initialisation_reading_an_outside_meta_tensor_is_refused() -> None:
    outside = torch.empty(3, 3, device="meta")
    with metadist.deferred_init():
        model = nn.Linear(3, 3)
        with torch.no_grad():
            model.weight.copy_(outside)
    with pytest.raises(ValueError, match="read a meta tensor created outside"):
        metadist.strategy("single").setup_module(model)
