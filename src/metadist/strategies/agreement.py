"""What must be equal on every rank, compared in one collective, before anything depends on it.

[Note: why a mechanism]
Every strategy computes one process's result only if every rank runs the same program on
the same model with the same optimizer and options. A rank whose model has another shape
fails deep in a collective ("Received data size doesn't match"); a rank with another
learning rate trains silently to other values. So setup describes what must agree as a list
of named items (each parameter's and buffer's name, shape, dtype and ``requires_grad``; the
strategy's name and options; the optimizer's class and every param group's hyperparameters
and parameter shapes) and compares them across ranks in one all-gather of a 32-byte digest.
Where the digests differ, a second collective brings every rank's items, and every rank
stops with the same error naming the first item that differs, the ranks and both values.

[Note: during training]
What a program or a scheduler changes later (the param groups' hyperparameters), the
number of steps taken, and the backward passes and collectives on the world group since the
previous step are compared at every ``optimizer.step()`` of an optimizer set up by a
strategy (:class:`StepAgreement`, the step chain's ``"agree"`` phase): each rank's three
integers (a 63-bit digest of the hyperparameters and the two counts) in one all-gather on
a gloo group of its own, so that it never pairs with a training collective of a rank whose
program went another way. The all-gather runs while the next step computes (a blocking one
exposes every rank's wait at each step: up to 40% of a small model's step); its answer is
read at the next step, which a difference stops on every rank, naming the count or the
hyperparameter and the step it was made at. So a difference trains one step, then stops: a
rank that skipped a step or ran an extra backward is named by its counts, without a second
collective (its training collectives no longer pair).
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from metadist.comm import ops
from metadist.runtime.tracker import TRACKER


@dataclass(frozen=True)
class Item:
    """One thing every rank must hold alike: what it is, and its value here (as text)."""

    name: str
    value: str


def module_items(module: nn.Module) -> list[Item]:
    """The module's parameters and buffers: names, shapes, dtypes, ``requires_grad``."""
    out = [Item(f"parameter '{n}'", f"shape {tuple(p.shape)}, {p.dtype}, "
                                    f"requires_grad={p.requires_grad}")
           for n, p in module.named_parameters()]
    out += [Item(f"buffer '{n}'", f"shape {tuple(b.shape)}, {b.dtype}")
            for n, b in module.named_buffers()]
    return out or [Item("the model's parameters and buffers", "none")]


def options_items(strategy: str, options: Any) -> list[Item]:
    """The strategy's name and every option's value."""
    from dataclasses import fields

    return [Item("strategy", strategy), *(
        Item(f"option {f.name}", _text(getattr(options, f.name))) for f in fields(options))]


def optimizer_items(optimizer: Optimizer) -> list[Item]:
    """The optimizer's class and every param group's hyperparameters and parameter shapes."""
    out = [Item("optimizer", f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"),
           Item("optimizer param groups", str(len(optimizer.param_groups)))]
    for i, group in enumerate(optimizer.param_groups):
        shapes = [tuple(p.shape) for p in group["params"]]
        out.append(Item(f"param group {i} parameters", f"{len(shapes)} of shapes {shapes}"))
        out += [Item(f"param group {i} {key}", _text(value)) for key, value in group.items()
                if key != "params"]
    return out


def loader_items(loader: Any, shards_itself: bool) -> list[Item]:
    """A data loader's dataset (its length, unless each rank's dataset is its own shard),
    batch size and sampling."""
    from collections.abc import Sized

    dataset = loader.dataset
    out = [Item("dataset", f"{type(dataset).__module__}.{type(dataset).__qualname__}")]
    if isinstance(dataset, Sized) and not shards_itself:
        out.append(Item("dataset length", str(len(dataset))))
    sampler = getattr(loader, "sampler", None)
    out += [Item("batch_size", repr(loader.batch_size)),
            Item("drop_last", repr(loader.drop_last)),
            Item("sampler", type(sampler).__qualname__ if sampler is not None else "none")]
    return out


def _text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return repr(value.tolist()) if value.numel() <= 16 else (
            f"tensor of shape {tuple(value.shape)} (sum {float(value.sum()):.17g})")
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple | list):
        return repr(type(value)(_text(v) for v in value))
    return repr(value)


def agree(what: str, items: Sequence[Item], advice: str) -> None:
    """Stop every rank unless every rank holds ``items`` alike (``what``: the call being
    made; ``advice``: what to write instead). One collective; two where ranks differ."""
    _, size, _ = ops.group_info(None)
    if size == 1:
        return
    text = "\n".join(f"{i.name}\t{i.value}" for i in items).encode()
    digest = torch.tensor(list(hashlib.sha256(text).digest()), dtype=torch.uint8)
    device = _device()
    mine = digest.to(torch.int64).to(device)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    ops.all_gather(everyone, mine)
    rows = everyone.view(size, -1)
    if bool((rows == rows[0]).all()):
        return
    lists = ops.all_gather_object([(i.name, i.value) for i in items])
    raise ValueError(_difference(what, lists, advice))


def _difference(what: str, lists: list[list[tuple[str, str]]], advice: str) -> str:
    """The first item that differs between rank 0 and another rank, as a message."""
    first = dict(lists[0])
    for items in lists[1:]:
        theirs = dict(items)
        for name in [*first, *(n for n in theirs if n not in first)]:
            if first.get(name) != theirs.get(name):
                here = first.get(name, "nothing (no such item)")
                there = theirs.get(name, "nothing (no such item)")
                others = [r for r, other in enumerate(lists)
                          if dict(other).get(name) == theirs.get(name)]
                return (f"{what}: the ranks must hold the same {name}, but rank 0 has "
                        f"{here} and rank{'s' if len(others) > 1 else ''} "
                        f"{', '.join(map(str, others))} {'have' if len(others) > 1 else 'has'} "
                        f"{there}. {advice}")
    return f"{what}: the ranks' descriptions differ in their order. {advice}"


def _device() -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: backward passes that reduced gradients, in this process (strategies count them where a
#: backward's reduction ends): compared between steps
_BACKWARDS = [0]


def count_backward() -> None:
    """A backward pass of a set-up model reduced its gradients."""
    _BACKWARDS[0] += 1


class _Control:
    """A gloo group of the whole world for the step agreement: its collective can never pair
    with a training collective of a rank whose program went another way (a skipped step or
    an extra backward), which on the world group aborts in native code or hangs."""

    world: Any = None
    group: Any = None

    @classmethod
    def get(cls) -> Any:
        world = dist.group.WORLD
        if cls.world is not world:  # built once per world, by every rank (setup_optimizer)
            from datetime import timedelta

            from metadist.runtime import watchdog

            limit = timedelta(seconds=watchdog.current_timeout())
            cls.world, cls.group = world, dist.new_group(backend="gloo", timeout=limit)
        return cls.group


class StepAgreement:
    """Each step of ``optimizer``: its step count, the backward passes and world collectives
    since the previous step, and every param group's hyperparameters, the same on every
    rank, or every rank stops (module notes). The comparison of a step runs while the next
    step computes, and is read at the next step, before it changes anything: a difference
    stops every rank one step after it was made."""

    def __init__(self, optimizer: Optimizer, strategy: str) -> None:
        self.optimizer, self.strategy, self.steps = optimizer, strategy, 0
        self._group = _Control.get()
        self._size = dist.get_world_size(self._group)
        self._since = (_BACKWARDS[0], TRACKER.seq(dist.group.WORLD))
        # one buffer each, made once: a step allocates no tensor of its own (written through
        # numpy, the CPU tensors of the gloo group)
        self._mine = torch.zeros(3, dtype=torch.int64)
        self._everyone = torch.zeros(self._size * 3, dtype=torch.int64)
        self._pending: tuple[Any, int, list[Item]] | None = None

    def items(self) -> list[Item]:
        """The hyperparameters (compared as a digest; named where they differ)."""
        out: list[Item] = []
        for i, group in enumerate(self.optimizer.param_groups):
            out += [Item(f"param group {i} {key}", _text(value))
                    for key, value in group.items() if key != "params"]
        return out

    def __call__(self) -> None:
        self.check()
        self.steps += 1
        items = self.items()
        text = "\n".join(f"{i.name}\t{i.value}" for i in items).encode()
        digest = int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1
        now = (_BACKWARDS[0], TRACKER.seq(dist.group.WORLD))
        self._mine.numpy()[:] = (digest, now[0] - self._since[0], now[1] - self._since[1])
        self._since = now
        # control traffic on its own group: 24 bytes a rank a step, outside metadist.comm's
        # counters (which account for the training's collectives); bounded by its timeout
        work = ops.all_gather_single(self._everyone, self._mine, group=self._group,
                                     async_op=True)
        self._pending = (work, self.steps, items)

    def check(self) -> None:
        """Read the last step's comparison (waits for it); raise on every rank where the
        ranks differed."""
        if self._pending is None:
            return
        handle, step, items = self._pending
        self._pending = None
        what = f"optimizer.step() #{step} under {self.strategy!r}"
        try:
            handle.wait()
        except RuntimeError as exc:
            raise RuntimeError(
                f"{what}: the ranks' comparison of this step did not complete ({exc}); a rank "
                f"did not reach its step #{step}: it skipped optimizer.step() calls, or "
                "stopped. Call optimizer.step() on every rank alike") from exc
        rows = self._everyone.view(self._size, -1)
        if bool((rows == rows[0]).all()):
            return
        counted = _counts(rows, step)
        if counted is not None:
            raise ValueError(f"{what}: {counted}. Every rank must run the same backward passes "
                             "and call optimizer.step() together: a rank that skips a step or "
                             "runs an extra backward pairs its gradient reductions with "
                             "another rank's next ones")
        lists: list[Any] = [None] * self._size
        dist.all_gather_object(lists, [(i.name, i.value) for i in items], group=self._group)
        raise ValueError(_difference(
            what, lists,
            "Every rank must step together with the same hyperparameters: change a learning "
            "rate (or a scheduler's) on every rank alike, and call optimizer.step() on every "
            "rank"))


def _counts(rows: torch.Tensor, step: int) -> str | None:
    """The count that differs between ranks (backward passes, collectives), in words;
    None when only the hyperparameters differ."""
    since = f"since optimizer.step() #{step - 1}" if step > 1 else "before the first step"
    for column, noun in ((1, f"backward passes {since}"),
                         (2, f"collectives on the world group {since}")):
        values = rows[:, column].tolist()
        if len(set(values)) > 1:
            other = next(r for r, v in enumerate(values) if v != values[0])
            same = [r for r, v in enumerate(values) if v == values[other]]
            who = f"rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))}"
            return (f"the ranks must have made the same number of {noun}, but rank 0 made "
                    f"{values[0]} and {who} made {values[other]}")
    return None


#: each user's module set up, and the strategy that did it: a second setup would build a
#: second set of gradient hooks, buckets or shards over tensors the first still holds
_SET_UP: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def mark_set_up(module: nn.Module, strategy: str) -> None:
    """``module`` (the user's) was set up by ``strategy``."""
    _SET_UP[module] = strategy


def check_not_set_up(module: nn.Module) -> None:
    """Refuse a second setup of the same module, naming the first."""
    first = _SET_UP.get(module)
    if first is not None:
        raise ValueError(
            f"this {type(module).__name__} was set up already, by strategy '{first}': a second "
            "setup would build its own gradient hooks and state over parameters the first "
            "still holds, and train to other values than one process. Keep using the model "
            "the first setup returned, or set up a fresh module (copy.deepcopy(net) before "
            "the first setup)")
