"""``torchopt.distributed.world`` on metadist: world info, worker ids and names, barriers, rank
decorators and :func:`auto_init_rpc`, with TorchOpt's signatures and names.

Differences kept on purpose: the rank decorators read the rank when the function is called
(TorchOpt: when it is decorated), which is the same under every launcher and also right for
functions decorated before the job starts; worker ids and names are checked, with errors that
list the workers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from metadist.compat.torchopt.distributed import _session
from metadist.compat.torchopt.distributed._session import default_worker_name_format
from metadist.errors import MetadistError
from metadist.mapreduce import session as mr_session
from metadist.mapreduce import world as mr_world
from metadist.runtime.ranks import not_on_rank, on_rank, rank_non_zero_only, rank_zero_only

F = TypeVar("F", bound=Callable[..., Any])


class WorldInfo(mr_world.WorldInfo):
    """This process's place in the job (a tuple: ``world_rank, world_size, local_rank,
    local_world_size``), with TorchOpt's ``rank`` and ``worker_name``."""

    __slots__ = ()

    @property
    def worker_name(self) -> str:
        """This worker's name under the format in force (TorchOpt's unless
        :func:`auto_init_rpc` was given another)."""
        return _session.name_format()(world_rank=self.world_rank, world_size=self.world_size,
                                      local_rank=self.local_rank,
                                      local_world_size=self.local_world_size)


_ATTRIBUTES = ("world_rank", "world_size", "local_rank", "local_world_size")


def get_world_info() -> WorldInfo:
    """Rank, world size, local rank and local world size of this process.

    As in TorchOpt, the function also carries the latest answer as attributes
    (``get_world_info.rank``, ``.world_size``, ..., upper-case aliases too).
    """
    info = WorldInfo(*mr_world.get_world_info())
    values: dict[str, Any] = {"world_info": info, "rank": info.rank}
    values.update((name, getattr(info, name)) for name in _ATTRIBUTES)
    for name, value in values.items():
        setattr(get_world_info, name, value)
        setattr(get_world_info, name.upper(), value)
    return info


# The plain accessors are metadist's own (the same numbers).
get_world_rank, get_rank = mr_world.get_world_rank, mr_world.get_rank
get_world_size, get_local_rank = mr_world.get_world_size, mr_world.get_local_rank
get_local_world_size = mr_world.get_local_world_size


# The function's attributes exist from import on, as in TorchOpt. A launch environment that
# cannot be read raises again, with its message, at the first call that needs it.
with contextlib.suppress(Exception):
    get_world_info()


def get_worker_id(id: str | int | None = None) -> int:
    """The global rank of a worker given by rank or by name; ``None`` means this process."""
    if not isinstance(id, str):
        return mr_world.get_worker_id(id)  # checks the rank's range and the type
    names = [_session.worker_name(rank) for rank in range(get_world_size())]
    if id not in names:
        raise ValueError(f"no worker is named {id!r}; the workers are: {', '.join(names)}")
    return names.index(id)


def barrier(worker_names: Iterable[str] | None = None) -> None:
    """Block until every worker in ``worker_names`` (default, or empty: all) reaches a
    barrier with the same names; only the named workers may call it.

    Under rpc this is RPC's barrier, as in TorchOpt; under spmd a collective barrier, which
    every rank must join (a subset of workers needs the rpc engine).
    """
    if isinstance(worker_names, str):
        raise TypeError(f"barrier(worker_names={worker_names!r}) takes an iterable of worker "
                        f"names, e.g. [{worker_names!r}], not one string")
    config = _session.start()
    names = set(worker_names) if worker_names is not None else set()
    ranks = {get_worker_id(name) for name in names}
    if names and get_world_rank() not in ranks:
        raise ValueError(
            f"barrier(worker_names={sorted(names)}) was called on "
            f"{_session.worker_name(get_world_rank())}, which is not among them; only the named "
            "workers may call it, so name this worker too or do not call it here")
    everyone = not names or len(ranks) == get_world_size()
    if config.engine == "rpc":
        from torch.distributed import rpc

        rpc.api._all_gather(None, None if everyone else names)
    elif everyone:
        mr_session.barrier()
    else:
        raise MetadistError(
            f"barrier(worker_names={sorted(names)}) synchronises part of the workers, which "
            "needs the rpc engine; under spmd every rank calls barrier() with no names")


def auto_init_rpc(worker_init_fn: Callable[[], None] | None = None,
                  worker_name_format: Callable[..., str] = default_worker_name_format,
                  *, backend: Any = None, rpc_backend_options: Any = None,
                  engine: str | None = None) -> Callable[[F], F]:
    """Decorate the program's entry function: calling it starts the session (collective),
    runs ``worker_init_fn`` on every rank between barriers, then the function itself.

    TorchOpt's semantics: ``worker_name_format`` applies from this call on (the decorator
    runs at import), and RPC stays up after the function returns, until interpreter exit,
    where every rank waits for the others (a graceful shutdown): ranks whose function
    returned at once (everything under ``@rank_zero_only``) serve until the driver is done.

    ``engine`` (metadist's addition; default ``$METADIST_MAPREDUCE_ENGINE``, else ``"rpc"``,
    TorchOpt's model) picks the engine; ``backend`` and ``rpc_backend_options`` are torch's
    RPC transport settings.
    """
    if engine is not None:
        mr_session.choose_engine(engine)  # a misspelt engine fails here, not at the first call
    _session.set_name_format(worker_name_format)

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            _session.start(engine, backend=backend, rpc_backend_options=rpc_backend_options)
            if worker_init_fn is not None:
                barrier()
                worker_init_fn()
            barrier()
            return func(*args, **kwargs)

        return cast(F, wrapped)

    return decorate


def rank_all(func: F) -> F:
    """Decorator that runs the function on every rank (it is the function itself)."""
    return func


__all__ = [
    "auto_init_rpc",
    "barrier",
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
]
