"""Checkpoints: the data loader's position, resumed exactly at the same or another world
size and batch size, and carried in checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import metadist
from metadist.data import DistributedBatchSampler, DistributedDataLoader, distribute_loader
from metadist.testing import run_on_ranks

# ----- the data loader's position -----------------------------------------------------------

def _loaders(world: int, batch: int, n: int = 50, **kw: Any) -> list[DistributedDataLoader]:
    out = []
    for rank in range(world):
        loader = distribute_loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=batch,
                                              shuffle=True, **kw), rank=rank, world_size=world)
        assert isinstance(loader, DistributedDataLoader)
        out.append(loader)
    return out


def _global(loaders: list[DistributedDataLoader], steps: int | None = None) -> list[list[int]]:
    """Global batches (every rank's slice, concatenated) of the next iteration."""
    iters = [iter(lo) for lo in loaders]
    out: list[list[int]] = []
    while steps is None or len(out) < steps:
        parts = [next(it, None) for it in iters]
        if parts[0] is None:
            return out
        # a rank left without samples at a ragged end reads a stand-in: leave it out
        out.append([i for lo, part in zip(loaders, parts, strict=True) if part is not None
                    for i in part[0][:lo.local_samples].tolist()])
    return out


@pytest.mark.parametrize(("world", "batch", "new_world", "new_batch"),
                         [(2, 6, 2, 6), (2, 6, 3, 4), (3, 4, 1, 12), (2, 5, 3, 3)])
def test_resumed_loader_yields_exactly_the_remaining_batches(
        world: int, batch: int, new_world: int, new_batch: int) -> None:
    straight = _loaders(world, batch)
    _global(straight)
    epoch1, epoch2 = _global(straight), _global(straight)
    first = _loaders(world, batch)
    _global(first)  # epoch 0 done
    head = _global(first, steps=2)  # two global batches of epoch 1, then "crash"
    state = first[0].state_dict()
    assert all(lo.state_dict() == state for lo in first)  # the same on every rank
    assert state == {"epoch": 1, "steps": 2, "consumed": 2 * world * batch}
    resumed = _loaders(new_world, new_batch)
    for lo in resumed:
        lo.load_state_dict(state)
    left = len(resumed[0])
    rest = _global(resumed)
    assert left == len(rest)

    def flat(bs: list[list[int]]) -> list[int]:
        return [i for b in bs for i in b]

    assert flat(head + rest) == flat(epoch1)  # the epoch's order, nothing repeated or skipped
    if world * batch == new_world * new_batch:
        assert head + rest == epoch1  # the same global batches
    assert resumed[0].state_dict() == {"epoch": 2, "steps": 0, "consumed": 0}
    assert flat(_global(resumed)) == flat(epoch2)  # then the next epoch, as uninterrupted


def test_loader_state_at_an_epoch_end_and_with_a_custom_batch_sampler() -> None:
    loaders = _loaders(2, 5, n=20)
    _global(loaders, steps=2)  # the last step of the epoch: 20 samples consumed
    assert loaders[0].state_dict() == {"epoch": 1, "steps": 0, "consumed": 0}
    ds = TensorDataset(torch.arange(10))

    class Pairs(BatchSampler):  # a custom batch sampler: whole batches are dealt to ranks
        pass

    custom = Pairs(SequentialSampler(range(10)), 2, False)  # 5 batches
    dealt = [distribute_loader(DataLoader(ds, batch_sampler=custom), rank=r, world_size=2)
             for r in range(2)]
    iters = [iter(lo) for lo in dealt]
    for it in iters:
        next(it)
    state = dealt[0].state_dict()
    assert state == {"epoch": 0, "steps": 1, "consumed": 2}  # two source batches
    again = [distribute_loader(DataLoader(ds, batch_sampler=custom), rank=r, world_size=3)
             for r in range(3)]
    for lo in again:
        lo.load_state_dict(state)
    assert [[b[0].tolist() for b in lo] for lo in again] == [[[4, 5]], [[6, 7]], [[8, 9]]]
    sampler = DistributedBatchSampler(range(10), 2, rank=0, world_size=2)
    list(sampler)
    assert sampler.state_dict() == {"epoch": 1, "steps": 0, "consumed": 0}
    sampler.load_state_dict({"epoch": 0, "steps": 1, "consumed": 4})
    assert len(sampler) == 2 and list(sampler) == [[4, 5], [8]]
    with pytest.raises(ValueError, match="non-negative integers"):
        dealt[0].load_state_dict({"epoch": -1})


def _loader_through_checkpoint(path: str, save: bool) -> list[list[int]]:
    s = metadist.strategy("ddp")
    loader = s.setup_dataloader(DataLoader(TensorDataset(torch.arange(40)), batch_size=20
                                           // metadist.world().world_size, shuffle=True))
    if save:
        it = iter(loader)
        next(it)
        s.save(path, {"loader": loader})
    else:
        s.load(path, {"loader": loader})
    return [b[0].tolist() for b in loader]


def test_loader_position_travels_in_checkpoints(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    run_on_ranks(_loader_through_checkpoint, 2, args=(path, True))
    ranks = run_on_ranks(_loader_through_checkpoint, 4, args=(path, False))
    rest = [i for r in ranks for b in r for i in b]
    full = [i for b in _global(_loaders(2, 10, n=40)) for i in b]
    assert sorted(rest) == sorted(full[20:]) and len(ranks[0]) == 1
