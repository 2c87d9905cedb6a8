"""Loader re-creation: every rank reads its contiguous share of each global batch, epochs
advance by themselves, ragged ends are weighted, and the result equals one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

import metadist
from metadist.data import DistributedBatchSampler, DistributedDataLoader, distribute_loader
from metadist.testing import run_on_ranks
from parity import ATOL, RTOL


def _ids(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _epoch(loader: DataLoader[tuple[torch.Tensor]]) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def _plan(n: int, world: int, batch: int, drop_last: bool = False,
          shuffle: bool = False) -> list[list[list[int]]]:
    """Every rank's batches of one epoch (computed without processes)."""
    out = []
    for rank in range(world):
        loader = DataLoader(_ids(n), batch_size=batch, drop_last=drop_last, shuffle=shuffle)
        out.append(_epoch(distribute_loader(loader, rank=rank, world_size=world)))
    return out


def test_global_batches_are_split_into_contiguous_slices() -> None:
    ranks = _plan(24, world=3, batch=4)
    assert ranks[0][0] == [0, 1, 2, 3] and ranks[1][0] == [4, 5, 6, 7]
    assert ranks[2][1] == [20, 21, 22, 23]
    assert all(len(r) == 2 for r in ranks)


def test_ragged_end_is_split_evenly_without_repeating_samples() -> None:
    ranks = _plan(29, world=3, batch=4)  # 2 full global batches, then 5 samples
    assert [r[-1] for r in ranks] == [[24, 25], [26, 27], [28]]
    seen = sorted(i for r in ranks for b in r for i in b)
    assert seen == list(range(29))  # each sample exactly once: nothing padded


def test_a_rank_without_samples_gets_a_stand_in_with_weight_zero() -> None:
    loaders = [distribute_loader(DataLoader(_ids(26), batch_size=4), rank=r, world_size=3)
               for r in range(3)]
    weights = []
    for loader in loaders:
        seen: list[tuple[float, float]] = []
        assert isinstance(loader, DistributedDataLoader)
        loader._on_batch = lambda local, total, seen=seen: seen.append((local, total))
        batches = _epoch(loader)
        weights.append(seen)
        assert len(batches) == 3  # every rank takes part in every step
    assert [w[-1] for w in weights] == [(1, 2), (1, 2), (0, 2)]
    assert [w[0] for w in weights] == [(4, 12)] * 3


def test_drop_last_drops_the_ragged_global_batch() -> None:
    ranks = _plan(29, world=3, batch=4, drop_last=True)
    assert all(len(r) == 2 for r in ranks)


def test_shuffle_agrees_across_ranks_and_changes_each_epoch() -> None:
    loaders = [distribute_loader(DataLoader(_ids(40), batch_size=5, shuffle=True), rank=r,
                                 world_size=2) for r in range(2)]
    first = [_epoch(lo) for lo in loaders]
    second = [_epoch(lo) for lo in loaders]  # set_epoch happened by itself
    for epoch in (first, second):
        seen = sorted(i for rank in epoch for b in rank for i in b)
        assert seen == list(range(40))  # a partition: ranks drew the same permutation
    assert first[0] != second[0]
    assert first[0][0] != list(range(5))


def test_loader_properties_are_preserved() -> None:
    def collate(items: list[tuple[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([i[0] for i in items]) * 10

    loader = DataLoader(_ids(12), batch_size=3, collate_fn=collate, num_workers=1,
                        pin_memory=False, persistent_workers=True, drop_last=True)
    out = distribute_loader(loader, rank=1, world_size=2)
    assert isinstance(out, DistributedDataLoader)
    assert out.num_workers == 1 and out.persistent_workers and out.collate_fn is collate
    assert isinstance(out.batch_sampler, DistributedBatchSampler)
    assert out.batch_sampler.batch_size == 3 and out.batch_sampler.drop_last
    assert len(out) == 2
    assert [b.tolist() for b in out] == [[30, 40, 50], [90, 100, 110]]


def test_already_distributed_and_self_sharding_loaders_are_left_alone() -> None:
    ds = _ids(8)
    mine = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    assert distribute_loader(mine, rank=0, world_size=2) is mine

    class Stream(IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(4))

    stream = DataLoader(Stream(), batch_size=2)
    assert distribute_loader(stream, rank=0, world_size=2, dataset_shards_itself=True) is stream
    assert distribute_loader(stream, rank=0, world_size=1) is stream  # nothing to split


def test_custom_batch_sampler_deals_whole_batches() -> None:
    class Buckets(BatchSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([[0, 1, 2], [3, 4], [5, 6, 7, 8], [9]])

        def __len__(self) -> int:
            return 4

    ranks = []
    for r in range(3):
        loader = DataLoader(_ids(10), batch_sampler=Buckets(SequentialSampler(range(10)), 1,
                                                            False))
        ranks.append(_epoch(distribute_loader(loader, rank=r, world_size=3)))
    assert ranks[0] == [[0, 1, 2], [9]]
    # ranks 1 and 2 have no batch in the second round: a stand-in (weight 0) keeps them in step
    assert ranks[1] == [[3, 4], [9]] and ranks[2] == [[5, 6, 7, 8], [9]]


class _Noisy(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(1)  # a random "augmentation"


def _worker_randomness() -> list[float]:
    s = metadist.strategy("ddp")
    loader = s.setup_dataloader(DataLoader(_Noisy(), batch_size=2, num_workers=1))
    return [v for b in loader for v in b.flatten().tolist()]


def test_workers_are_seeded_differently_on_each_rank() -> None:
    a, b = run_on_ranks(_worker_randomness, 2)
    assert a != b


# ----- end to end: training through the loader equals one process ------------------------

def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader, epochs: int,
           backward=None) -> None:  # type: ignore[no-untyped-def, type-arg]
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            (backward or (lambda t: t.backward()))(loss)
            opt.step()


def _loader_training(n: int, batch: int, shuffle: bool) -> dict[str, torch.Tensor]:
    net = _net()
    s = metadist.strategy("ddp")
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    loader = s.setup_dataloader(DataLoader(_dataset(n), batch_size=batch, shuffle=shuffle))
    _train(model, opt, loader, epochs=2, backward=s.backward)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _reference(n: int, global_batch: int, shuffle: bool) -> dict[str, torch.Tensor]:
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ds = _dataset(n)
    for epoch in range(2):
        if shuffle:  # the order every rank draws: the sampler under seed 0 + epoch
            with torch.random.fork_rng():
                torch.manual_seed(epoch)
                order = list(RandomSampler(ds))
        else:
            order = list(range(n))
        loader = DataLoader(ds, batch_size=global_batch, sampler=order)
        _train(net, opt, loader, epochs=1)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize(("n", "world", "shuffle"), [
    (53, 3, False),  # ragged end of 5 samples: ranks weighted 2/5, 2/5, 1/5
    (50, 3, True),  # ragged end of 2 < 3: one rank joins with a weight-0 stand-in
    (40, 2, True),
    (37, 4, False),
])
def test_training_through_the_loader_equals_one_process(n: int, world: int,
                                                        shuffle: bool) -> None:
    want = _reference(n, 4 * world, shuffle)
    for got in run_on_ranks(_loader_training, world, args=(n, 4, shuffle)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)
