"""Start and stop the process group; answer "who am I" with a frozen :class:`World`."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import sys
import threading
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist

from metadist.errors import NotInitializedError
from metadist.runtime import env as launch_env
from metadist.runtime import failures, rendezvous, watchdog
from metadist.runtime.tracker import configure_debug

BACKENDS = ("gloo", "nccl", "mpi")


class SelfGroup:
    """A group that holds only this rank: every collective on it is the identity.

    Used where a topology degenerates, e.g. the cross-node group of a one-node job, so callers
    never special-case it and no socket is opened for it.
    """

    _instance: SelfGroup | None = None

    def __new__(cls) -> SelfGroup:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "SELF"


SELF = SelfGroup()
Group: TypeAlias = "dist.ProcessGroup | SelfGroup | None"
"""A communication group: a torch ProcessGroup, :data:`SELF`, or ``None`` for the whole world."""


@dataclass(frozen=True)
class World:
    """This process's place in the job. Immutable: re-read it with :func:`metadist.world`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    backend: str
    device: torch.device
    launcher: str

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def root_rank(self) -> int:
        """The rank that plays root where a collective needs one and none is given (0)."""
        return 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass
class _Runtime:
    world: World
    owns_group: bool
    node_group: Group
    cross_node_group: Group


_lock = threading.Lock()
_runtime: _Runtime | None = None


def _gpus_for_every_local_rank(local_world_size: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size


def _choose_backend(requested: str | None, local_world_size: int) -> str:
    match requested:
        case None | "auto":
            return "nccl" if _gpus_for_every_local_rank(local_world_size) else "gloo"
        case "nccl":
            if not torch.cuda.is_available():
                raise ValueError("backend 'nccl' needs CUDA GPUs and none is visible; use 'gloo'")
            return "nccl"
        case "gloo" | "mpi":
            return requested
        case _:
            raise ValueError(
                f"backend {requested!r} is not known; choose one of: auto, {', '.join(BACKENDS)}"
            )


def _pick_device(requested: str | torch.device | None, backend: str, local_rank: int,
                 local_world_size: int) -> torch.device:
    """The device a rank uses (:func:`init` then selects it: ``torch.cuda.set_device``)."""
    if requested is not None:
        device = torch.device(requested)
        if str(device) == "cuda":  # no index given: this rank's own GPU
            device = torch.device("cuda", local_rank)
    elif backend == "nccl" or _gpus_for_every_local_rank(local_world_size):
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if (device.type == "cuda" and device.index is not None
            and device.index >= torch.cuda.device_count()):
        raise ValueError(
            f"local rank {local_rank} wants {device} but only {torch.cuda.device_count()} "
            "GPU(s) are visible; start fewer processes per node or pass device='cpu'"
        )
    return device


def _hybrid_groups(world: World) -> tuple[Group, Group]:
    """Node-local and cross-node groups; collective: every rank builds every group in order."""
    if world.world_size == 1:
        return None, SELF
    if world.num_nodes == 1:
        return None, SELF
    per_node = world.local_world_size
    if world.world_size != world.num_nodes * per_node or (
        world.rank != world.node_rank * per_node + world.local_rank
    ):
        # Heterogeneous or non node-major placement: hybrid sharding cannot use node groups.
        return None, None
    node_group: Group = None
    cross_group: Group = None
    for node in range(world.num_nodes):
        group = dist.new_group(list(range(node * per_node, (node + 1) * per_node)))
        if node == world.node_rank:
            node_group = group
    for local in range(per_node):
        group = dist.new_group(list(range(local, world.world_size, per_node)))
        if local == world.local_rank:
            cross_group = group
    return node_group, cross_group


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None, *,
         device: str | torch.device | None = None, debug: bool | None = None,
         rendezvous_timeout: float | datetime.timedelta | None = None) -> World:
    """Join the job this process was launched into and return its :class:`World`.

    Idempotent: later calls return the same world. Adopts a process group the user already
    initialised. A plain single process (or any world of one) opens no sockets. On one
    machine every socket metadist opens listens on loopback only.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``None``/``"auto"`` (nccl when every
            local rank has its own GPU, else gloo).
        timeout: seconds (or a timedelta) the rendezvous and every collective may wait
            (default ``$METADIST_TIMEOUT``, else 300). A collective still waiting then stops
            every rank with an error naming the op, its call number and the missing ranks.
        device: override the device (default: ``cuda:<local_rank>`` with GPUs, else cpu).
        debug: cross-check every collective's fingerprint on all ranks first (default
            ``$METADIST_DEBUG``); see :func:`metadist.comm.set_debug`.
        rendezvous_timeout: seconds the rendezvous alone may wait (default: ``timeout``),
            for jobs whose processes start far apart but whose collectives must not wait.
    """
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime.world
        limit = watchdog.resolve_timeout(timeout)
        configure_debug(debug)
        detected = launch_env.detect()
        config = watchdog.WatchdogConfig.for_timeout(limit)
        world = _check_answered(detected, _planned(detected, backend, device))
        if world.device.type == "cuda":
            torch.cuda.set_device(world.device)
        if dist.is_available() and dist.is_initialized():
            _runtime = _Runtime(world, False, *_hybrid_groups(world))
            if world.world_size > 1:
                watchdog.start(config, world.rank, rendezvous.adopted_progress())
            return world
        if detected.world_size == 1:
            _runtime = _Runtime(world, False, None, SELF)
            return world
        if not detected.master_addr:
            raise launch_env.LaunchEnvError(
                f"{detected.launcher} job spans {detected.num_nodes} nodes but MASTER_ADDR is not "
                "set; export MASTER_ADDR=<address of the node running rank 0> (and MASTER_PORT) "
                "for every rank"
            )
        joining = limit if rendezvous_timeout is None else watchdog.resolve_timeout(
            rendezvous_timeout)
        progress = rendezvous.join(detected, world.backend, world.device, joining, limit)
        watchdog.start(config, world.rank, progress)
        node_group, cross_group = _hybrid_groups(world)
        _runtime = _Runtime(world, True, node_group, cross_group)
        _destroy_at_exit()
        return world


_exit_hook = False


def _destroy_at_exit() -> None:
    """A program that ends without metadist.shutdown() (Betty's and most torch programs)
    still destroys the group it got: left to interpreter teardown, gloo's threads can abort
    the process ("terminate called without an active exception") after the work is done."""
    global _exit_hook
    if not _exit_hook:
        atexit.register(_shutdown_quietly)
        _exit_hook = True


def _shutdown_quietly() -> None:
    # After an uncaught error the rank did not leave cleanly: keep that for the watchdog's
    # report (its own exit hook decides), and let the launcher stop the job.
    if getattr(sys, "last_value", None) is not None or failures.failed_here():
        return
    with contextlib.suppress(Exception):
        shutdown()


def _planned(detected: launch_env.LaunchEnv, backend: str | None,
             device: str | torch.device | None) -> World:
    """The :class:`World` ``init(backend, device=device)`` makes, from the launch environment
    (and a process group the user already created) alone: nothing is joined or selected."""
    if dist.is_available() and dist.is_initialized():  # adopted
        rank, size = dist.get_rank(), dist.get_world_size()
        adopted = str(dist.get_backend())
        if detected.rank == rank and detected.world_size == size:
            local_rank, local_size = detected.local_rank, detected.local_world_size
            node_rank, num_nodes, launcher = (detected.node_rank, detected.num_nodes,
                                              detected.launcher)
        else:
            local_rank, local_size, node_rank, num_nodes, launcher = rank, size, 0, 1, "user"
        dev = _pick_device(device, adopted, local_rank, local_size)
        return World(rank, size, local_rank, local_size, node_rank, num_nodes, adopted, dev,
                     launcher)
    chosen = _choose_backend(backend, detected.local_world_size)
    if detected.world_size == 1:
        return World(0, 1, 0, 1, 0, 1, "none", _pick_device(device, chosen, 0, 1),
                     detected.launcher)
    dev = _pick_device(device, chosen, detected.local_rank, detected.local_world_size)
    return World(detected.rank, detected.world_size, detected.local_rank,
                 detected.local_world_size, detected.node_rank, detected.num_nodes, chosen, dev,
                 detected.launcher)


# What peek() answered before init, and from which launch environment.
_answered: tuple[launch_env.LaunchEnv, World] | None = None


def peek() -> World:
    """This process's :class:`World` without joining the job: the initialised one, else the
    one :func:`init` with default arguments will make, read from the launch environment
    (nothing is joined, no socket opened). An ``init`` that would then make another world
    (other ``backend``/``device`` arguments) raises instead of contradicting the answer."""
    global _answered
    with _lock:
        if _runtime is not None:
            return _runtime.world
        detected = launch_env.detect()
        world = _planned(detected, None, None)
        _answered = (detected, world)
        return world


def _check_answered(detected: launch_env.LaunchEnv, world: World) -> World:
    global _answered
    answered, _answered = _answered, None
    if answered is not None and answered[0] == detected and answered[1] != world:
        raise ValueError(
            f"strategy.world (or .device) was read before metadist.init and answered "
            f"{answered[1]}, but this init makes {world}; call metadist.init(...) with these "
            "arguments before reading strategy.world or strategy.device")
    return world


def forget_inherited() -> None:
    """Drop a runtime copied into a forked child: the child must join its own job."""
    global _runtime, _answered
    _runtime = _answered = None
    watchdog.forget_inherited()


def is_initialized() -> bool:
    return _runtime is not None


def _require() -> _Runtime:
    if _runtime is None:
        raise NotInitializedError(
            "metadist is not initialised in this process; call metadist.init() first "
            "(metadist.launch and `metadist run` do it for you)"
        )
    return _runtime


def world() -> World:
    """The :class:`World` of this process (after :func:`init`)."""
    return _require().world


def node_group() -> Group:
    """The ranks on this node (``None`` means the whole world, on a one-node job)."""
    return _require().node_group


def cross_node_group() -> Group:
    """The ranks with this local rank on every node (:data:`SELF` on a one-node job)."""
    runtime = _require()
    if runtime.world.num_nodes > 1 and runtime.cross_node_group is None:
        raise ValueError(
            "cross-node groups need the same number of ranks on every node, placed node-major "
            "(rank = node_rank * local_world_size + local_rank); launch with an even layout"
        )
    return runtime.cross_node_group


def shutdown() -> None:
    """Leave the job: destroy the process group metadist created. Safe to call twice."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
        world = runtime.world if runtime is not None else None
        # Rank 0 may host the store the others still publish their leaving to.
        others = tuple(range(1, world.world_size)) if world and world.rank == 0 else ()
        watchdog.stop(leaving=runtime is not None, others=others)
        if runtime is not None and runtime.owns_group and dist.is_initialized():
            dist.destroy_process_group()

