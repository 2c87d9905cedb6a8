"""Test helpers: run a body on N real ranks (gloo), fail fast on hangs, name the rank.

Pools of ranks are kept per (world size, nodes, backend) and reused across calls, so a test
suite pays process start-up once per layout; a body that fails or hangs closes its pool and
the next call starts a fresh one. Bodies must be importable (module-level functions) and must
not call :func:`metadist.shutdown`.
"""

from __future__ import annotations

import atexit
import gc
import ipaddress
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from metadist.comm import ops
from metadist.runtime.spawn import RankPool
from metadist.strategies.tensors.elsewhere import ElsewhereGrad
from metadist.strategies.zero3.gather_buffers import let_go

_pools: dict[tuple[int, int, str | None, int], RankPool] = {}


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                 kwargs: dict[str, Any] | None = None, *, timeout: float = 120.0,
                 nnodes: int = 1, backend: str | None = "gloo", threads: int = 1) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world_size`` ranks; results in rank order.

    Raises :class:`~metadist.errors.RankFailedError` (with the rank's traceback) or
    :class:`~metadist.errors.LaunchTimeoutError` (naming the hung ranks, with their stacks).
    """
    key = (world_size, nnodes, backend, threads)
    pool = _pools.get(key)
    if pool is None or pool.closed:
        pool = RankPool(world_size, backend=backend, nnodes=nnodes, timeout=timeout,
                        threads=threads)
        _pools[key] = pool
    return pool.run(fn, args, kwargs, timeout)


def close_pools() -> None:
    """Stop every cached pool (registered to run at interpreter exit)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()


atexit.register(close_pools)


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once;
    freed storages count zero; FSDP2's DTensors count their local shard): the per-rank
    memory measure of the ZeRO formulas."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None or isinstance(tensor, ElsewhereGrad):  # zero2: no storage here
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _storage_ptrs(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


class _StorageTracker(TorchDispatchMode):
    """Remembers, weakly, every storage an operator allocates. Outputs that share an input's
    storage (views such as ``weight.t()``, in-place results) allocated nothing: counting them
    would count the parameters as activations."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        # The storages themselves (weakly), for their size now: a storage resized to zero
        # (a freed gather buffer) holds nothing, one resized up holds more.
        self.live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0  # the most bytes alive at once, after any operator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = _storage_ptrs((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() in inputs and storage.nbytes():
                    continue
                self.refs[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                self.live[storage._cdata] = weakref.ref(storage)
        self.peak = max(self.peak, self._now())
        return out

    def __enter__(self) -> _StorageTracker:
        # The gather buffers are a cache of whole buffers (strategies/zero3/gather_buffers.py):
        # emptied on entry, what a computation reuses from it is allocated, and counted,
        # inside; emptied on exit, its idle buffers are not memory left alive.
        let_go()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        let_go()

    def _now(self) -> int:
        # Freed storages are gone at once (reference counting): no collection needed here.
        return sum(s.nbytes() for ref in self.live.values() if (s := ref()) is not None)

    def alive_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def bytes_kept_by(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), bytes)``: the bytes of storages that operators allocated inside ``fn`` and
    that are still alive when it returns, e.g. the activations a forward keeps for
    backward. A measure of tensors, immune to the allocator's caching (unlike RSS)."""
    with _StorageTracker() as tracker:
        out = fn()
    return out, tracker.alive_bytes()


def peak_bytes_of(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), bytes)``: the most bytes of storages allocated inside ``fn`` that were alive
    at once (e.g. a sharded setup's peak), measured at every allocation."""
    with _StorageTracker() as tracker:
        out = fn()
    return out, tracker.peak


#: aten ops that make the host wait for the device's result (``.item()``, ``bool(t)``, ...)
HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero")
#: Tensor methods that copy to the host without a dispatched op when the tensor is on the CPU
_HOST_COPY_METHODS = ("tolist", "numpy", "cpu")


class OpCount(TorchDispatchMode):
    """The aten ops run inside (each a kernel launch on a GPU), the host syncs among them and
    the ops that read one of ``watched`` (e.g. the gradients: how many passes a step makes
    over them). Counted on the CPU, these are what a fast GPU pays for, independent of load."""

    def __init__(self, watched: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.watched = {t.untyped_storage().data_ptr() for t in watched}
        self.ops: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        self.syncs += name in HOST_SYNC_OPS
        if self.watched and any(isinstance(t, torch.Tensor) and t.device.type != "meta"
                                and t.untyped_storage().data_ptr() in self.watched
                                for t in tree_leaves((args, kwargs))):
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@contextmanager
def count_ops(watched: Iterable[torch.Tensor] = ()) -> Iterator[OpCount]:
    """Count the aten ops and host syncs run inside the block (:class:`OpCount`).
    ``.tolist()``/``.numpy()``/``.cpu()`` count as syncs too: on a CPU tensor they dispatch
    nothing, on a GPU they wait for it."""
    mode = OpCount(watched)
    originals = {m: getattr(torch.Tensor, m) for m in _HOST_COPY_METHODS}

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            mode.syncs += 1
            return method(*args, **kwargs)
        return call

    try:
        for m, f in originals.items():
            setattr(torch.Tensor, m, counted(f))
        with mode:
            yield mode
    finally:
        for m, f in originals.items():
            setattr(torch.Tensor, m, f)


def gather_from_ranks(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor`` (same shape everywhere), in rank order."""
    _, size, _ = ops.group_info(None)
    flat = tensor.detach().reshape(-1).contiguous()
    out = flat.new_empty(size * flat.numel())
    ops.all_gather(out, flat)
    return [piece.view_as(tensor) for piece in out.chunk(size)] if flat.numel() else [tensor] * size


def assert_same_on_all_ranks(tensor: torch.Tensor, what: str = "tensor") -> None:
    """Raise AssertionError unless every rank holds exactly this tensor."""
    copies = gather_from_ranks(tensor)
    for rank, copy in enumerate(copies):
        if not torch.equal(copy, copies[0]):
            diff = (copy.float() - copies[0].float()).abs().max().item()
            raise AssertionError(f"{what} differs between rank 0 and rank {rank} "
                                 f"(max abs difference {diff:.3g})")


def _decode(hexaddr: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order) as text."""
    raw = bytes.fromhex(hexaddr)
    host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(host))


def listening_addresses(pid: int | None = None) -> list[str]:
    """The local addresses (e.g. ``"127.0.0.1"``, ``"::"``) of the listening TCP sockets of
    process ``pid`` (default: this one), from Linux's /proc: what a security test checks."""
    where = f"/proc/{pid if pid is not None else 'self'}"
    inodes = set()
    for fd in os.listdir(f"{where}/fd"):
        try:
            target = os.readlink(f"{where}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"{where}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state 0A: LISTEN
                    found.append(_decode(cols[1].split(":")[0]))
    return found


def is_loopback_address(address: str) -> bool:
    """``127.x``, ``::1`` and IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
