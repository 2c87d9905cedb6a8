"""Distributed sampling and loader re-creation.

Every global step reads one global batch of ``world_size x batch_size`` samples, split into
contiguous per-rank slices, so step k on N ranks sees exactly the samples a single process
with batch ``N x batch_size`` would. Nothing is padded with repeated samples: a ragged last
global batch is split as evenly as possible, a rank left without samples gets one stand-in
sample with weight 0, and each rank reports (its samples, the global batch's samples) so the
gradient sync weights ranks and the result stays the single-process mean.

Where an epoch's order comes from: by default from the loader's sampler under a random
state seeded with ``seed + epoch``, the same on every rank whatever else the program draws.
With ``seed=None``, from the process's global random generator, drawn when the epoch's
iteration starts, as torch's own loader draws it (its workers' base seed on ``iter()``, its
sampler's permutation at the first batch): a seeded program then reads, in one process,
exactly the batches its own loader would, and on N ranks the same global order (every rank
draws, rank 0's order is used by all).

Position (``state_dict()`` / ``load_state_dict()`` of the loader and the sampler): the epoch,
the global steps taken in it and the samples (for a custom batch sampler: its batches) they
consumed. It does not depend on the world size: a resumed loader continues the epoch's global
order right after the last consumed sample, cut into global batches of its own size, so with
the same global batch size it yields exactly the remaining global batches.
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

BatchHook = Callable[[float, float], None]
_POSITION = ("epoch", "steps", "consumed")


@dataclass(frozen=True)
class _Step:
    indices: list[int]
    local: int  # real samples on this rank (0: a stand-in sample that must not count)
    total: int  # samples in the global batch
    units: int  # what the global step consumes of the epoch's order: samples, or batches


def _position(state: Mapping[str, Any]) -> tuple[int, int, int]:
    """(epoch, steps, consumed) from a loader or sampler state dict, checked."""
    values = [state.get(k) if isinstance(state, Mapping) else None for k in _POSITION]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"a loader state needs non-negative integers {', '.join(_POSITION)}; "
                         f"got {state!r} (pass what loader.state_dict() returned)")
    epoch, steps, consumed = values
    assert isinstance(epoch, int) and isinstance(steps, int) and isinstance(consumed, int)
    return epoch, steps, consumed


class DistributedBatchSampler(Sampler[list[int]]):
    """Batches of indices for one rank; the global order is the same on every rank.

    ``order_source`` yields the epoch's global sample order; it is drawn under a random
    state seeded by ``seed + epoch`` so a shuffling sampler agrees across ranks, or with
    ``seed=None`` under the global random state, rank 0's draw used by all. With
    ``batches=True`` the source yields whole batches (a custom batch sampler), which are
    dealt to ranks round-robin instead of being cut into slices.

    ``state_dict()`` counts the batches this sampler handed out; behind a DataLoader with
    workers that runs ahead of training, so checkpoint the loader's state instead.
    """

    def __init__(self, order_source: Iterable[Any], batch_size: int, *, rank: int,
                 world_size: int, drop_last: bool = False, seed: int | None = 0,
                 batches: bool = False) -> None:
        if batch_size < 1 and not batches:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.source = order_source
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.drop_last, self.seed, self.batches = drop_last, seed, batches
        self.epoch = 0
        self.start = 0  # units of the epoch's order already consumed before this iteration
        self.start_steps = 0  # global steps already taken in the epoch before this iteration
        self._drawn = 0
        self._plan: tuple[tuple[int, int, int], list[_Step], list[int]] | None = None

    def set_epoch(self, epoch: int, start: int = 0, start_steps: int = 0) -> None:
        """Iterate epoch ``epoch`` next, from ``start`` units (samples, or batches of a custom
        batch sampler) into its order, counting ``start_steps`` global steps already taken."""
        self.epoch, self.start, self.start_steps = epoch, start, start_steps

    def _draw(self) -> list[Any]:
        if isinstance(self.source, SequentialSampler):  # no randomness to seed: every epoch
            return list(range(len(self.source)))        # is 0..n-1 (no RNG fork, ~70 us)
        if self.seed is None:  # the global random state, as the user's own loader would
            order = list(iter(self.source))
            if self.world_size > 1:
                from metadist.comm import ops

                order = ops.broadcast_object(order, 0)
            return order
        # The CPU generator only (forked and restored): torch.manual_seed would also reseed
        # every accelerator's generator, which fork_rng(devices=[]) does not restore, and
        # costs about 1 ms.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(self.seed + self.epoch)
            state = random.getstate()
            random.seed(self.seed + self.epoch)
            try:
                return list(iter(self.source))
            finally:
                random.setstate(state)

    def plan(self) -> list[_Step]:
        """This rank's remaining batches of the current epoch with their weights."""
        # A sequential source plans the same steps every epoch (for the same length): keep them.
        key = ((-1, self.start, len(self.source)) if isinstance(self.source, SequentialSampler)
               else (self.epoch, self.start, 0))
        if self._plan is None or self._plan[0] != key:
            drawn = self._draw()[self.start:]
            steps = self._plan_batches(drawn) if self.batches else self._plan_samples(drawn)
            consumed = list(itertools.accumulate(s.units for s in steps))
            self._plan = (key, steps, consumed)
        return self._plan[1]

    def position(self, taken: int) -> dict[str, int]:
        """The state after ``taken`` steps of the current plan: the next epoch once all are."""
        steps = self.plan()
        assert self._plan is not None
        if taken >= len(steps):
            return {"epoch": self.epoch + 1, "steps": 0, "consumed": 0}
        consumed = self.start + (self._plan[2][taken - 1] if taken else 0)
        return {"epoch": self.epoch, "steps": self.start_steps + taken, "consumed": consumed}

    def state_dict(self) -> dict[str, int]:
        """Epoch, global steps and units handed out so far (see the module docstring)."""
        return self.position(self._drawn)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (taken at any world size)."""
        epoch, steps, consumed = _position(state)
        self.set_epoch(epoch, consumed, steps)
        self._drawn = 0

    def _plan_samples(self, order: list[int]) -> list[_Step]:
        n, b, r = self.world_size, self.batch_size, self.rank
        size = n * b
        steps = []
        full = len(order) // size
        for k in range(full):
            start = k * size + r * b
            steps.append(_Step(order[start:start + b], b, size, size))
        rest = order[full * size:]
        if rest and not self.drop_last:
            # Split the ragged remainder contiguously, sizes differing by at most one.
            base, extra = divmod(len(rest), n)
            start = r * base + min(r, extra)
            mine = rest[start:start + base + (1 if r < extra else 0)]
            steps.append(_Step(mine or [rest[0]], len(mine), len(rest), len(rest)))
        return steps

    def _plan_batches(self, batches: list[list[int]]) -> list[_Step]:
        n, r = self.world_size, self.rank
        rounds = len(batches) // n if self.drop_last else -(-len(batches) // n)
        steps = []
        for k in range(rounds):
            group = batches[k * n:(k + 1) * n]
            total = sum(len(bt) for bt in group)
            mine = group[r] if r < len(group) else None
            steps.append(_Step(list(mine) if mine else list(group[0]), len(mine or []), total,
                               len(group)))
        return steps

    def __iter__(self) -> Iterator[list[int]]:
        self._drawn = 0
        for step in self.plan():
            self._drawn += 1
            yield step.indices

    def __len__(self) -> int:
        # samples, or batches, left in the epoch
        count = max(0, len(self.source) - self.start)  # type: ignore[arg-type]
        per_step = self.world_size if self.batches else self.world_size * self.batch_size
        return count // per_step if self.drop_last else -(-count // per_step)


class DistributedDataLoader(DataLoader[Any]):
    """A DataLoader whose epochs advance the sampler and report each batch's weight.

    ``local_samples`` is the number of real samples in the batch just yielded: 0 for a
    stand-in batch (a rank left without data at a ragged end), which evaluation loops should
    mask out while still running the forward (collectives must stay in step across ranks).

    ``state_dict()`` is the position after the batches yielded so far (a batch counts as
    consumed once yielded); after ``load_state_dict(state)`` the next iteration continues
    that epoch with the next global batch, even at another world size.
    """

    def __init__(self, *args: Any, on_batch: BatchHook | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_batch = on_batch
        self._epoch = 0
        self._resume = (0, 0)  # (consumed, steps) the next iteration starts from
        self._state = {"epoch": 0, "steps": 0, "consumed": 0}
        self.local_samples = 0

    @property
    def _sampler(self) -> DistributedBatchSampler:
        sampler = self.batch_sampler
        assert isinstance(sampler, DistributedBatchSampler)
        return sampler

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shuffle seed) of the next iteration; it then counts up from there."""
        self._epoch, self._resume = epoch, (0, 0)
        self._state = {"epoch": epoch, "steps": 0, "consumed": 0}

    def state_dict(self) -> dict[str, int]:
        """Epoch, global steps taken in it and samples they consumed (world-size independent)."""
        return dict(self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next iteration continue from ``state`` (from :meth:`state_dict`)."""
        epoch, steps, consumed = _position(state)
        self._epoch, self._resume = epoch, (consumed, steps)
        self._state = {"epoch": epoch, "steps": steps, "consumed": consumed}
        self._sampler.set_epoch(epoch, consumed, steps)  # so that len(loader) is what is left

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self._sampler
        sampler.set_epoch(self._epoch, *self._resume)
        self._epoch, self._resume = self._epoch + 1, (0, 0)
        # torch's iterator draws its workers' base seed now, and the order is drawn when the
        # first batch is asked for: the global random state is consumed as by torch's loader
        return self._batches(sampler, super().__iter__())

    def _batches(self, sampler: DistributedBatchSampler, batches: Iterator[Any]
                 ) -> Iterator[Any]:
        steps = sampler.plan()
        self._state = sampler.position(0)
        for k, (step, batch) in enumerate(zip(steps, batches, strict=False)):
            self.local_samples = step.local
            if self._on_batch is not None:
                self._on_batch(step.local, step.total)
            self._state = sampler.position(k + 1)
            yield batch
        sampler.set_epoch(self._epoch)  # exhausted: len(self) is the next epoch's again


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


def _check_splittable(loader: DataLoader[Any], world_size: int,
                      dataset_shards_itself: bool) -> bool:
    """False when ``loader`` must be returned as is; raises when splitting it by index
    cannot work and returning it as is would feed every rank the same samples."""
    dataset = loader.dataset
    name = type(dataset).__name__
    if isinstance(dataset, IterableDataset):
        if dataset_shards_itself or world_size == 1:
            return False
        raise ValueError(
            f"setup_dataloader: the loader reads an IterableDataset ({name}), which cannot be "
            "split by index, so every rank would read the same samples. Shard it inside the "
            "dataset (e.g. yield every world_size-th item from metadist.world().rank on) and "
            "pass setup_dataloader(loader, dataset_shards_itself=True), or use a map-style "
            "Dataset with __len__ and __getitem__. (A metadist.meta.Problem reads any iterable "
            "that is not a DataLoader as it is.)")
    if dataset_shards_itself:
        raise ValueError(f"setup_dataloader: dataset_shards_itself=True is for an "
                         f"IterableDataset; {name} is a map-style dataset, which metadist "
                         "splits by index itself: drop the option")
    batch_sampler = loader.batch_sampler
    if (type(batch_sampler) is BatchSampler and isinstance(batch_sampler.sampler, (
            SequentialSampler, RandomSampler)) and not isinstance(dataset, Sized)):
        raise ValueError(
            f"setup_dataloader: dataset {name} has no __len__, so its samples cannot be split "
            "into per-rank index slices. Give it a __len__ (the number of samples), or make it "
            "an IterableDataset that shards itself and pass "
            "setup_dataloader(loader, dataset_shards_itself=True)")
    return True


def distribute_loader(loader: DataLoader[Any], *, rank: int, world_size: int,
                      seed: int | None = 0,
                      on_batch: BatchHook | None = None,
                      dataset_shards_itself: bool = False) -> DataLoader[Any]:
    """Re-create ``loader`` for ``rank`` of ``world_size``, keeping its batch size, shuffle,
    drop_last, collate_fn, workers and pinning. A loader that already has a distributed
    sampler is returned as is. An IterableDataset cannot be split by index: it must shard
    itself, which ``dataset_shards_itself=True`` declares (the loader is then returned as
    is); without it, more than one rank is an error rather than duplicated data.
    ``seed=None``: draw the order from the global random state (see the module notes)."""
    if _is_distributed(loader) or not _check_splittable(loader, world_size,
                                                        dataset_shards_itself):
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
    # (seed=None: the user's generator, drawn from as torch's own loader would.)
    generator = loader.generator
    if seed is not None:
        generator = torch.Generator()
        base = loader.generator.initial_seed() if loader.generator is not None else seed
        generator.manual_seed(base * 1_000_003 + rank)
    return DistributedDataLoader(
        loader.dataset, batch_sampler=sampler, worker_init_fn=_SeedWorkers(loader.worker_init_fn),
        generator=generator, on_batch=on_batch, **kwargs)

