"""Deferred initialisation: build a model without allocating it, and materialise it later,
one piece at a time, with exactly the values eager construction would have given.

Under :func:`deferred_init` tensors that would be created on the CPU are created on the meta
device instead (no memory) while every
operation that creates or writes one is logged: the factory (``empty``, ``arange``), the
initialisers (``uniform_``, ``normal_``, ``fill_`` on a view, ``copy_``), with the random
generator's state before each random one. Each random operation is also run once on a scratch
tensor of the same shape, so the generator advances exactly as in eager construction and the
program after the ``with`` block draws the same numbers. Materialising a tensor replays only
the logged operations it depends on, in their original order and with their recorded
generator states, on the CPU (where eager construction runs): its values are bit-identical
to eager construction with the same seed, whatever order the pieces are materialised in.
That order freedom is what lets zero3/hsdp allocate one unit at a time.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from metadist.comm import fused, ops

_CPU = torch.device("cpu")
_META = torch.device("meta")


@dataclass(frozen=True)
class _Ref:
    """A meta tensor argument: a view (size, stride, offset, dtype) of a logged storage."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Entry:
    """One logged operation."""

    func: Any  # an aten OpOverload
    args: tuple[Any, ...]  # meta tensors replaced by _Ref
    kwargs: dict[str, Any]
    reads: frozenset[int]
    writes: frozenset[int]  # storages it writes in place or creates
    created: tuple[tuple[int, int], ...]  # (output leaf index, new storage key)
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator and its state before


_ID = "_metadist_deferred_id"  # a logged storage's serial number
_LOG = "_metadist_deferred_log"  # and its log: the model's storages keep the log alive
_serial = itertools.count()


def _key(t: torch.Tensor) -> int:
    """The serial number of ``t``'s storage (-1: never logged). Storage objects persist as
    long as a tensor uses them, so a number is never reused, unlike an address."""
    return int(getattr(t.untyped_storage(), _ID, -1))


def _ref(t: torch.Tensor) -> _Ref:
    return _Ref(_key(t), tuple(int(n) for n in t.shape), tuple(int(n) for n in t.stride()),
                int(t.storage_offset()), t.dtype)


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments ``func``'s schema marks as written (``self`` of ``uniform_``, ``out=``)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return written


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


@dataclass
class DeferredLog:
    """The operations of one :func:`deferred_init` block, and what they created."""

    entries: list[_Entry] = field(default_factory=list)
    # Storages that cannot be replayed, and why (an input the log never saw created).
    broken: dict[int, str] = field(default_factory=dict)

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        leaves = tree_flatten(out)[0]
        created = []
        for i, t in enumerate(leaves):
            if _is_meta(t) and _key(t) < 0:
                storage = t.untyped_storage()
                setattr(storage, _ID, next(_serial))
                setattr(storage, _LOG, self)
                created.append((i, _key(t)))
        reads = {_key(t) for t in tree_flatten((args, kwargs))[0] if _is_meta(t)}
        writes = {_key(t) for t in _written_args(func, args, kwargs) if _is_meta(t)}
        if not writes and not created:
            return  # a view, or a query: nothing to replay
        unknown = {-1} & reads
        targets = writes | {k for _, k in created}
        if unknown:
            for k in targets:
                self.broken[k] = (f"{func} read a meta tensor created outside "
                                  "metadist.deferred_init()")
        for k in targets:  # a broken input breaks what is computed from it
            if reads & self.broken.keys() and k not in self.broken:
                self.broken[k] = self.broken[next(iter(reads & self.broken.keys()))]
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            gen = kwargs.get("generator") or torch.default_generator
            rng = (gen, gen.get_state())
            _advance(func, args, kwargs)  # as eager construction would have
        snap = tree_map(lambda x: _ref(x) if _is_meta(x) else
                        (x.clone() if isinstance(x, torch.Tensor) else x), (args, kwargs))
        self.entries.append(_Entry(func, snap[0], snap[1], frozenset(reads),
                                   frozenset(targets), tuple(created), rng))

    def materialize(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Real CPU tensors holding the values eager construction gave ``tensors`` (same
        shapes, strides and dtypes). The random generators are left as they were."""
        refs = [_ref(t) for t in tensors]
        for ref, t in zip(refs, tensors, strict=True):
            if getattr(t.untyped_storage(), _LOG, None) is not self:
                raise ValueError(
                    f"a meta tensor of shape {tuple(t.shape)} was not built under "
                    "metadist.deferred_init() (or was replaced after it, e.g. by .to() or "
                    ".half() outside the block): build the whole model inside the block, and "
                    "convert it there (a conversion after setup is refused where the "
                    "strategy's state would not follow)")
            if ref.key in self.broken:
                raise ValueError(
                    f"a tensor of shape {tuple(t.shape)} cannot be materialised: "
                    f"{self.broken[ref.key]}. Create every tensor the model's initialisation "
                    "reads inside the block, or initialise that part after setup (e.g. with "
                    "load_state_dict)")
        real = self._replay({r.key for r in refs})
        return [_view(real[r.key], r) for r in refs]

    def _replay(self, keys: set[int]) -> dict[int, torch.UntypedStorage]:
        chosen, needed = [], set(keys)
        for entry in reversed(self.entries):  # the operations these storages depend on
            if entry.writes & needed:
                chosen.append(entry)
                needed |= entry.reads | entry.writes
        real: dict[int, torch.UntypedStorage] = {}
        saved: dict[torch.Generator, torch.Tensor] = {}
        try:
            for entry in reversed(chosen):
                if entry.rng is not None:
                    gen, state = entry.rng
                    saved.setdefault(gen, gen.get_state())
                    gen.set_state(state)
                args, kwargs = tree_map(lambda x: _on_cpu(x, real), (entry.args, entry.kwargs))
                leaves = tree_flatten(entry.func(*args, **kwargs))[0]
                for index, key in entry.created:
                    real[key] = leaves[index].untyped_storage()
        finally:
            for gen, state in saved.items():
                gen.set_state(state)
        return real


def _view(storage: torch.UntypedStorage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)


def _on_cpu(x: Any, real: dict[int, torch.UntypedStorage]) -> Any:
    if isinstance(x, _Ref):
        return _view(real[x.key], x)
    if isinstance(x, torch.device) and x.type == "meta":
        return _CPU
    return x


def _advance(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run a random operation once on scratch CPU tensors of the same geometry: the
    generator's consumption depends on shape and layout, not on values."""
    def scratch(x: Any) -> Any:
        if _is_meta(x):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_CPU)
        return _CPU if isinstance(x, torch.device) and x.type == "meta" else x
    cpu_args, cpu_kwargs = tree_map(scratch, (args, kwargs))
    func(*cpu_args, **cpu_kwargs)


class _Recorder(TorchDispatchMode):
    """Logs every operation that creates or writes a meta tensor. With ``redirect``, the
    tensors that would be created on the CPU are created on the meta device instead.

    Not ``torch.device("meta")``: libraries read that context to skip their weight
    initialisation on meta (HF transformers does), and the initialisation is what we log.
    Tensors made from data (``torch.tensor([...])``) stay real: they hold values."""

    def __init__(self, log: DeferredLog, redirect: bool) -> None:
        super().__init__()
        self.log, self.redirect = log, redirect

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if self.redirect and "device" in (a.name for a in func._schema.arguments):
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "cpu":
                kwargs["device"] = _META  # what would be allocated on the CPU is not
        out = func(*args, **kwargs)
        if any(_is_meta(t) for t in tree_flatten((args, kwargs, out))[0]):
            self.log.record(func, args, kwargs, out)
        return out


@contextmanager
def deferred_init() -> Iterator[DeferredLog]:
    """Build a model without allocating its tensors; ``strategy.setup`` materialises it.

    ``with metadist.deferred_init(): model = build()`` creates every parameter and buffer on
    the meta device and logs how they are initialised. zero3 and hsdp then materialise the
    model one unit at a time, each rank keeping only its shards; the other strategies
    materialise it whole. The values equal eager construction on the CPU with the same seed,
    and the random generator after the block is where eager construction leaves it.
    """
    log = DeferredLog()
    with _Recorder(log, redirect=True):
        yield log


@contextmanager
def recording(log: DeferredLog | None) -> Iterator[None]:
    """Log operations on the model's meta tensors again (setup converting a deferred model,
    e.g. its precision's dtype, before materialising it); nothing when ``log`` is None."""
    if log is None:
        yield
        return
    with _Recorder(log, redirect=False):
        yield


def log_of(model: nn.Module) -> DeferredLog | None:
    """The deferred-init log ``model``'s meta tensors were built under (None if none)."""
    metas = [t for t in (*model.parameters(), *model.buffers()) if t.is_meta]
    if not metas:
        return None
    log = getattr(metas[0].untyped_storage(), _LOG, None)
    return log if isinstance(log, DeferredLog) else None


def digest(log: DeferredLog) -> bytes:
    """What the log's values depend on beyond the program: the generator states it
    recorded. Equal digests on every rank mean equal values (no broadcast needed)."""
    h = hashlib.sha256(str(len(log.entries)).encode())
    for entry in log.entries:
        if entry.rng is not None:
            h.update(entry.rng[1].numpy().tobytes())
    return h.digest()


def materialize_params(params: Sequence[nn.Parameter], log: DeferredLog,
                       device: torch.device) -> None:
    """Give meta ``params`` their eager values on ``device``, in place: each Parameter
    object stays the same, so an optimizer built on the meta model keeps working."""
    todo = list({id(p): p for p in params if p.is_meta}.values())
    for p, value in zip(todo, log.materialize(todo), strict=True):
        torch.utils.swap_tensors(p, nn.Parameter(value.to(device), p.requires_grad))


def materialize_buffers(model: nn.Module, log: DeferredLog, device: torch.device) -> None:
    """Give ``model``'s meta buffers their eager values on ``device`` (buffers are small:
    every strategy keeps them whole)."""
    slots = [(m, n, b) for m in model.modules() for n, b in m._buffers.items()
             if b is not None and b.is_meta]
    for (module, name, _), value in zip(slots, log.materialize([b for *_, b in slots]),
                                        strict=True):
        module._buffers[name] = value.to(device)


def materialize(model: nn.Module, log: DeferredLog, device: torch.device = _CPU) -> None:
    """The whole model at once (the strategies that keep a full replica)."""
    materialize_buffers(model, log, device)
    materialize_params(list(model.parameters()), log, device)


def broadcast_state(tensors: Sequence[torch.Tensor]) -> None:
    """Every rank starts from rank 0's values (as eager construction under any seed)."""
    if tensors:
        with torch.no_grad():
            fused.fused_broadcast([t.data for t in tensors], src=0)


class DeferredSetup:
    """A sharded strategy's materialisation of a deferred model, unit by unit: buffers at
    once, then each unit's parameters when the strategy asks (it shards and frees them
    before the next). Ranks whose logs drew from different generator states take rank 0's
    values, as eager setup does; ranks that agree (the same seed) skip that broadcast."""

    def __init__(self, model: nn.Module, log: DeferredLog, device: torch.device) -> None:
        self.log, self.device = log, device
        mine = torch.tensor(list(digest(log)), dtype=torch.uint8, device=device)
        rank0 = mine.clone()
        fused.fused_broadcast([rank0], src=0)
        differs = torch.tensor([float(not torch.equal(mine, rank0))], device=device)
        ops.all_reduce(differs, "max")
        self.agree = not bool(differs.item())
        materialize_buffers(model, log, device)
        if not self.agree:
            broadcast_state(list(model.buffers()))

    @classmethod
    def of(cls, model: nn.Module, device: torch.device) -> DeferredSetup | None:
        log = log_of(model)
        return None if log is None else cls(model, log, device)

    def materialize(self, params: Sequence[nn.Parameter]) -> None:
        materialize_params(params, self.log, self.device)
        if not self.agree:
            broadcast_state(params)
