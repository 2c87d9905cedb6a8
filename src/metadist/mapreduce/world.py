"""Who am I in map-reduce terms: world info, worker names and worker ids.

Everything here reads metadist's runtime (or, before :func:`metadist.init`, the launcher's
environment), so it answers the same under either engine and before initialisation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from metadist.runtime import env as launch_env
from metadist.runtime import world as _world
from metadist.runtime.ranks import not_on_rank, on_rank, rank_non_zero_only, rank_zero_only

WorkerNameFormat = Callable[..., str]
DEFAULT_WORKER_NAME_FORMAT: WorkerNameFormat = "worker{world_rank}".format

_lock = threading.Lock()
_name_format: WorkerNameFormat = DEFAULT_WORKER_NAME_FORMAT


class WorldInfo(NamedTuple):
    """This process's place in the job, in TorchOpt's terms (a tuple, as there)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def rank(self) -> int:
        return self.world_rank

    @property
    def worker_name(self) -> str:
        return worker_name(self.world_rank)


def set_worker_name_format(fmt: WorkerNameFormat) -> None:
    """Name workers with ``fmt(world_rank=, world_size=, local_rank=, local_world_size=)``."""
    global _name_format
    with _lock:
        _name_format = fmt


def get_world_info() -> WorldInfo:
    """Rank, world size, local rank and local world size of this process."""
    if _world.is_initialized():
        w = _world.world()
        return WorldInfo(w.rank, w.world_size, w.local_rank, w.local_world_size)
    e = launch_env.detect()
    return WorldInfo(e.rank, e.world_size, e.local_rank, e.local_world_size)


def get_world_rank() -> int:
    """Global rank of this process."""
    return get_world_info().world_rank


get_rank = get_world_rank


def get_world_size() -> int:
    """Number of processes in the job."""
    return get_world_info().world_size


def get_local_rank() -> int:
    """Rank of this process on its node."""
    return get_world_info().local_rank


def get_local_world_size() -> int:
    """Number of processes on this node."""
    return get_world_info().local_world_size


def worker_name(rank: int) -> str:
    """The worker name of global rank ``rank`` (``"worker<rank>"`` unless configured)."""
    info = get_world_info()
    # Local ranks of other processes are not known here; assume the node-major layout every
    # launcher metadist supports uses.
    local_size = info.local_world_size
    return _name_format(world_rank=rank, world_size=info.world_size,
                        local_rank=rank % local_size, local_world_size=local_size)


def get_worker_id(id: int | str | None = None) -> int:
    """The global rank of a worker given by rank or by name; ``None`` means this process."""
    size = get_world_size()
    match id:
        case None:
            return get_world_rank()
        case bool():
            raise TypeError(f"worker id must be an int rank or a worker name, got {id!r}")
        case int():
            if not 0 <= id < size:
                raise ValueError(f"worker id {id} is outside the world of {size} ranks; "
                                 f"use a rank in 0..{size - 1}")
            return id
        case str():
            names = [worker_name(r) for r in range(size)]
            if id not in names:
                raise ValueError(f"no worker is named {id!r}; the workers are: {', '.join(names)}")
            return names.index(id)
        case _:
            raise TypeError(f"worker id must be an int rank or a worker name, got {id!r}")


__all__ = [
    "DEFAULT_WORKER_NAME_FORMAT",
    "WorldInfo",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_worker_id",
    "get_world_info",
    "get_world_rank",
    "get_world_size",
    "not_on_rank",
    "on_rank",
    "rank_non_zero_only",
    "rank_zero_only",
    "set_worker_name_format",
    "worker_name",
]
