"""Distributed sampling and loader re-creation.

Every global step reads one global batch of ``world_size x batch_size`` samples, split into
contiguous per-rank slices, so step k on N ranks sees exactly the samples a single process
with batch ``N x batch_size`` would. Nothing is padded with repeated samples: a ragged last
global batch is split as evenly as possible, a rank left without samples gets one stand-in
sample with weight 0, and each rank reports (its samples, the global batch's samples) so the
gradient sync weights ranks and the result stays the single-process mean.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from metadist.runtime.ranks import get_logger

BatchHook = Callable[[float, float], None]


@dataclass(frozen=True)
class _Step:
    indices: list[int]
    local: int  # real samples on this rank (0: a stand-in sample that must not count)
    total: int  # samples in the global batch


class DistributedBatchSampler(Sampler[list[int]]):
    """Batches of indices for one rank; the global order is the same on every rank.

    ``order_source`` yields the epoch's global sample order; it is drawn under a random
    state seeded by ``seed + epoch`` so a shuffling sampler agrees across ranks. With
    ``batches=True`` the source yields whole batches (a custom batch sampler), which are
    dealt to ranks round-robin instead of being cut into slices.
    """

    def __init__(self, order_source: Iterable[Any], batch_size: int, *, rank: int,
                 world_size: int, drop_last: bool = False, seed: int = 0,
                 batches: bool = False) -> None:
        if batch_size < 1 and not batches:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.source = order_source
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.drop_last, self.seed, self.batches = drop_last, seed, batches
        self.epoch = 0
        self._plan: tuple[int, list[_Step]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _draw(self) -> list[Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            state = random.getstate()
            random.seed(self.seed + self.epoch)
            try:
                return list(iter(self.source))
            finally:
                random.setstate(state)

    def plan(self) -> list[_Step]:
        """This rank's batches of the current epoch with their weights."""
        if self._plan is None or self._plan[0] != self.epoch:
            drawn = self._draw()
            steps = self._plan_batches(drawn) if self.batches else self._plan_samples(drawn)
            self._plan = (self.epoch, steps)
        return self._plan[1]

    def _plan_samples(self, order: list[int]) -> list[_Step]:
        n, b, r = self.world_size, self.batch_size, self.rank
        size = n * b
        steps = []
        full = len(order) // size
        for k in range(full):
            start = k * size + r * b
            steps.append(_Step(order[start:start + b], b, size))
        rest = order[full * size:]
        if rest and not self.drop_last:
            # Split the ragged remainder contiguously, sizes differing by at most one.
            base, extra = divmod(len(rest), n)
            start = r * base + min(r, extra)
            mine = rest[start:start + base + (1 if r < extra else 0)]
            steps.append(_Step(mine or [rest[0]], len(mine), len(rest)))
        return steps

    def _plan_batches(self, batches: list[list[int]]) -> list[_Step]:
        n, r = self.world_size, self.rank
        rounds = len(batches) // n if self.drop_last else -(-len(batches) // n)
        steps = []
        for k in range(rounds):
            group = batches[k * n:(k + 1) * n]
            total = sum(len(bt) for bt in group)
            mine = group[r] if r < len(group) else None
            steps.append(_Step(list(mine) if mine else list(group[0]), len(mine or []), total))
        return steps

    def __iter__(self) -> Iterator[list[int]]:
        return (step.indices for step in self.plan())

    def __len__(self) -> int:
        count = len(self.source)  # type: ignore[arg-type]  # samples, or batches
        per_step = self.world_size if self.batches else self.world_size * self.batch_size
        return count // per_step if self.drop_last else -(-count // per_step)


class DistributedDataLoader(DataLoader[Any]):
    """A DataLoader whose epochs advance the sampler and report each batch's weight.

    ``local_samples`` is the number of real samples in the batch just yielded: 0 for a
    stand-in batch (a rank left without data at a ragged end), which evaluation loops should
    mask out while still running the forward (collectives must stay in step across ranks).
    """

    def __init__(self, *args: Any, on_batch: BatchHook | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_batch = on_batch
        self._epoch = 0
        self.local_samples = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shuffle seed) of the next iteration; it then counts up from there."""
        self._epoch = epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.batch_sampler
        assert isinstance(sampler, DistributedBatchSampler)
        sampler.set_epoch(self._epoch)
        self._epoch += 1
        weights = [(step.local, step.total) for step in sampler.plan()]
        for (local, total), batch in zip(weights, super().__iter__(), strict=False):
            self.local_samples = local
            if self._on_batch is not None:
                self._on_batch(local, total)
            yield batch


class _SeedWorkers:
    """worker_init_fn: give numpy each worker's torch seed, then run the user's hook."""

    def __init__(self, user_fn: Callable[[int], Any] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        seed = torch.initial_seed() % 2**32
        random.seed(seed)
        try:
            import numpy as np

            np.random.seed(seed)
        except ImportError:
            pass
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _is_distributed(loader: DataLoader[Any]) -> bool:
    return isinstance(loader, DistributedDataLoader) or isinstance(
        loader.sampler, DistributedSampler) or isinstance(
        getattr(loader.batch_sampler, "sampler", None), DistributedSampler)


_KEEP = ("num_workers", "collate_fn", "pin_memory", "timeout", "multiprocessing_context",
         "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def distribute_loader(loader: DataLoader[Any], *, rank: int, world_size: int, seed: int = 0,
                      on_batch: BatchHook | None = None) -> DataLoader[Any]:
    """Re-create ``loader`` for ``rank`` of ``world_size``, keeping its batch size, shuffle,
    drop_last, collate_fn, workers and pinning. A loader that already has a distributed
    sampler, or reads an IterableDataset (which only the dataset itself can shard), is
    returned as is."""
    if _is_distributed(loader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        get_logger("data").warning(
            "setup_dataloader: an IterableDataset cannot be split by index; it is returned as "
            "is, so shard it inside the dataset (e.g. by metadist.world().rank)")
        return loader
    batch_sampler = loader.batch_sampler
    if type(batch_sampler) is BatchSampler and isinstance(batch_sampler.sampler, Sized):
        sampler = DistributedBatchSampler(
            batch_sampler.sampler, batch_sampler.batch_size, rank=rank, world_size=world_size,
            drop_last=batch_sampler.drop_last, seed=seed)
    elif batch_sampler is not None:
        # A custom batch sampler (bucketing by length, say): deal whole batches to ranks.
        sampler = DistributedBatchSampler(batch_sampler, 0, rank=rank, world_size=world_size,
                                          drop_last=loader.drop_last, seed=seed, batches=True)
    else:
        raise ValueError("setup_dataloader needs a loader with a batch size (batch_size=None "
                         "loaders yield single samples); batch the data or shard it yourself")
    kwargs = {k: getattr(loader, k) for k in _KEEP if hasattr(loader, k)}
    if loader.num_workers == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    accepted = inspect.signature(DataLoader.__init__).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    # Distinct worker seeds per rank: otherwise every rank draws the same augmentations.
    generator = torch.Generator()
    base = loader.generator.initial_seed() if loader.generator is not None else seed
    generator.manual_seed(base * 1_000_003 + rank)
    return DistributedDataLoader(
        loader.dataset, batch_sampler=sampler, worker_init_fn=_SeedWorkers(loader.worker_init_fn),
        generator=generator, on_batch=on_batch, **kwargs)

