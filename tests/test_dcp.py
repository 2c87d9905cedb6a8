"""torch's distributed checkpoint (DCP) reads and writes metadist's state, as one process's.

``metadist.checkpoint.dcp.get_state_dict(model, optimizer)`` gives the format of torch's own
``get_state_dict`` (the user's names, global shapes; the optimizer's state by parameter
name) whose tensors say where this rank holds their elements, so ``dcp.save`` and
``dcp.load`` move metadist's state to and from one process, FSDP2 and every strategy at any
world size. Each case saves after 5 steps, loads into a fresh model and optimizer (another
seed) and trains 5 more; the result equals one process's 10 steps on the whole batches.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_state

import metadist
from metadist.checkpoint import dcp as metadist_dcp
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

SAVED, STEPS, GLOBAL_BATCH = 5, 10, 12
SHARDING = {"zero3": {"min_unit_params": 10}, "hsdp": {"min_unit_params": 10}}
NODES = {"hsdp": 2}


class Net(nn.Module):
    """Layers whose shards cut across rows, a 3-d parameter and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.mix = nn.Parameter(torch.randn(3, 3, 3) * 0.3)
        self.register_buffer("scale", torch.tensor([1.5, 0.5, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.tanh(self.a(x))) @ self.mix.sum(0)) * self.scale


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _one_process(steps: range, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in steps:
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _want() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    _one_process(range(STEPS), model, _adamw(model.parameters()))
    return model.state_dict()


# ----- one process, torch's own API -----------------------------------------------------------
def _plain(path: str, save: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0 if save else 7)
    model = Net()
    opt = _adamw(model.parameters())
    if save:
        _one_process(range(SAVED), model, opt)
    msd, osd = torch_state.get_state_dict(model, opt)
    if save:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
        return {}
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    torch_state.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _one_process(range(SAVED, STEPS), model, opt)
    return model.state_dict()


# ----- metadist --------------------------------------------------------------------------------
def _rank_steps(model: nn.Module, opt: torch.optim.Optimizer, backward: Any, rank: int,
                n: int) -> Any:
    """Training steps on this rank's slice of each global batch."""
    per = GLOBAL_BATCH // n

    def steps(which: range) -> None:
        for step in which:
            x, y = _batch(step)
            part = slice(rank * per, (rank + 1) * per)
            backward(nn.functional.mse_loss(model(x[part]), y[part]))
            opt.step()
            opt.zero_grad()

    return steps


def _round_trip(path: str, save: bool, steps: Any, state: Any, apply: Any) -> bool:
    """Saving: the first SAVED steps, then a DCP save of ``state()``. Loading: a DCP load
    into ``state()``, ``apply``-ed, then the remaining steps. True when it loaded."""
    if save:
        steps(range(SAVED))
    msd, osd = state()
    if save:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        return False
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    apply(msd, osd)
    steps(range(SAVED, STEPS))
    return True


def _metadist(strategy: str, path: str, save: bool, built: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0 if save else 7)
    s = metadist.strategy(strategy, **SHARDING.get(strategy, {}))
    model = s.setup_module(Net())
    opt = (s.setup_optimizer(model, _adamw(model.parameters())) if built == "setup"
           else _adamw(model.parameters()))  # after setup, over the sharded parameters
    steps = _rank_steps(model, opt, s.backward, metadist.world().rank,
                        metadist.world().world_size)
    if not _round_trip(path, save, steps, lambda: metadist_dcp.get_state_dict(model, opt),
                       lambda m, o: metadist_dcp.set_state_dict(
                           model, opt, model_state_dict=m, optim_state_dict=o)):
        return {}
    return model.state_dict()


# ----- FSDP2 -----------------------------------------------------------------------------------
def _fsdp2(path: str, save: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    metadist.world()  # the process group
    torch.manual_seed(0 if save else 7)
    model = Net()
    for layer in (model.a, model.b, model):
        fully_shard(layer)
    opt = _adamw(model.parameters())
    steps = _rank_steps(model, opt, lambda loss: loss.backward(),
                        torch.distributed.get_rank(), torch.distributed.get_world_size())
    if not _round_trip(path, save, steps, lambda: torch_state.get_state_dict(model, opt),
                       lambda m, o: torch_state.set_state_dict(
                           model, opt, model_state_dict=m, optim_state_dict=o)):
        return {}
    full = torch_state.get_model_state_dict(
        model, options=torch_state.StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()}


def _run(side: tuple[Any, ...], path: str, save: bool) -> list[dict[str, torch.Tensor]]:
    kind, *rest = side
    if kind == "one process":
        return [_plain(path, save)]
    if kind == "FSDP2":
        return run_on_ranks(_fsdp2, rest[0], args=(path, save))
    strategy, n, built = rest
    return run_on_ranks(_metadist, n, args=(strategy, path, save, built),
                        nnodes=NODES.get(strategy, 1))


CASES = [
    (("metadist", "zero3", 2, "setup"), ("one process",)),
    (("metadist", "zero3", 3, "after"), ("one process",)),
    (("one process",), ("metadist", "zero3", 3, "after")),
    (("one process",), ("metadist", "hsdp", 4, "setup")),
    (("metadist", "hsdp", 4, "after"), ("metadist", "zero2", 3, "setup")),
    (("metadist", "zero2", 3, "setup"), ("metadist", "zero3", 2, "setup")),
    (("metadist", "ddp", 2, "setup"), ("metadist", "zero1", 3, "setup")),
    (("FSDP2", 2), ("metadist", "zero3", 3, "after")),
    (("metadist", "zero3", 3, "setup"), ("FSDP2", 2)),
]


def _id(side: tuple[Any, ...]) -> str:
    return "-".join(str(x) for x in side).replace(" ", "_")


@pytest.mark.parametrize(("saver", "loader"), CASES,
                         ids=[f"{_id(a)}->{_id(b)}" for a, b in CASES])
def test_dcp_moves_the_state_between_strategies_world_sizes_and_torch(
        tmp_path: Any, saver: tuple[Any, ...], loader: tuple[Any, ...]) -> None:
    path = str(tmp_path / "dcp")
    want = _want()
    _run(saver, path, True)
    for got in _run(loader, path, False):
        assert_tensors_close(got, want)


# ----- pieces ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), (5, 0), (1, 1)])
def test_boxes_cover_every_range_exactly_once(shape: tuple[int, ...]) -> None:
    """Every element range of a row-major tensor is the union of its boxes, each contiguous
    and in order ([Note: element ranges as boxes])."""
    n = math.prod(shape)
    index = torch.arange(n).view(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            found: list[int] = []
            for box in metadist_dcp.boxes(shape, start, stop):
                region = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes,
                                                                    strict=True))]
                values = region.reshape(-1).tolist()
                assert values == list(range(box.start, box.start + len(values)))
                found.extend(values)
            assert found == list(range(start, stop))
            assert len(metadist_dcp.boxes(shape, start, stop)) <= max(1, 2 * len(shape) - 1)


def _foreign_parameter() -> str:
    s = metadist.strategy("zero3", min_unit_params=10)
    model = s.setup_module(Net())
    opt = _adamw([*model.parameters(), nn.Parameter(torch.zeros(2))])
    try:
        metadist_dcp.get_state_dict(model, opt)
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_optimizer_over_a_tensor_outside_the_model_is_named() -> None:
    for message in run_on_ranks(_foreign_parameter, 2):
        assert "parameter 5 of the optimizer (AdamW) is not one of the model's" in message


def _own_format(strategy: str, path: str, save: bool, fmt: str) -> dict[str, torch.Tensor]:
    """An optimizer built over the sharded parameters after setup (FSDP2's habit), saved and
    resumed by metadist's own checkpoints."""
    torch.manual_seed(0 if save else 7)
    s = metadist.strategy(strategy, **SHARDING.get(strategy, {}))
    model = s.setup_module(Net())
    opt = _adamw(model.parameters())
    w = metadist.world()
    per = GLOBAL_BATCH // w.world_size
    if save:
        steps: range = range(SAVED)
    else:
        s.load(path, {"model": model, "optimizer": opt})
        steps = range(SAVED, STEPS)
    for step in steps:
        x, y = _batch(step)
        part = slice(w.rank * per, (w.rank + 1) * per)
        s.backward(nn.functional.mse_loss(model(x[part]), y[part]))
        opt.step()
        opt.zero_grad()
    if save:
        s.save(path, {"model": model, "optimizer": opt}, format=fmt)
    return model.state_dict()


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_an_optimizer_built_after_setup_saves_and_reshards(tmp_path: Any, fmt: str) -> None:
    """Its state is each parameter's slice (strategies/placement.py's ``_sliced``); before,
    the save stopped saying the ranks' training diverged."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_own_format, 2, args=("zero3", path, True, fmt))
    for got in run_on_ranks(_own_format, 3, args=("zero3", path, False, fmt)):
        assert_tensors_close(got, _want())


class WithScalar(nn.Module):
    """A 0-dim parameter (in a flat shard like any other) and BatchNorm's buffers (a 0-dim
    counter among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(torch.tanh(self.embed(x)))) / self.temperature


def _save_with_scalar(path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    s = metadist.strategy("zero3", min_unit_params=10, sync_batchnorm=True)
    model = s.setup_module(WithScalar())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    w = metadist.world()
    per = GLOBAL_BATCH // w.world_size
    for step in range(3):
        x, y = _batch(step)
        x = x[:, :4]
        part = slice(w.rank * per, (w.rank + 1) * per)
        s.backward(nn.functional.mse_loss(model(x[part]), y[part]))
        opt.step()
        opt.zero_grad()
    msd, osd = metadist_dcp.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": s.optimizer_state_dict(opt)}


def test_a_zero_dim_parameter_and_batchnorm_buffers_round_trip(tmp_path: Any) -> None:
    path = str(tmp_path / "dcp")
    saved = run_on_ranks(_save_with_scalar, 3, args=(path,))[0]
    torch.manual_seed(7)
    plain = WithScalar()
    opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    msd, osd = torch_state.get_state_dict(plain, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    torch_state.set_state_dict(plain, opt, model_state_dict=msd, optim_state_dict=osd)
    for name, value in saved["model"].items():  # copies of the same bytes: equal
        assert torch.equal(plain.state_dict()[name], value), name
    for index, entry in saved["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(opt.state_dict()["state"][index][key], value), (index, key)
