"""Which collectives this process has entered and which are still in flight.

``comm`` calls :meth:`Tracker.enter` before every collective and :meth:`Tracker.exit` once
it has finished. That is the whole hot-path cost: a per-group counter, one small object and
a set insert under a lock (1-2 us, against tens of microseconds for the smallest gloo
collective). Nothing here talks to other ranks; the watchdog thread reads this state and
publishes it to the store only when a collective has been waiting for a while.

Only a collective that somebody is blocked on can time out: a synchronous one from entry, an
async one from the moment its handle is waited (an async handle that is never waited, e.g. a
prefetch that was not needed, is nobody's hang).

Sequence numbers count per process group, so ranks of a sub-group agree on them even when
other ranks issue collectives on other groups.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


def compact_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: rank lists stay short at any world size."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}"
                     for a, b in spans)


@dataclass(frozen=True)
class GroupInfo:
    """A process group as every member names it: torch's group name and global ranks."""

    name: str
    ranks: tuple[int, ...]
    label: str  # for messages: "the world group" or "group 3 (ranks 0-3)"


class CollectiveCall:
    """One collective this process entered: where, which call, since when, and its works."""

    __slots__ = ("device", "group", "op", "seq", "start", "within", "works")

    def __init__(self, group: GroupInfo, seq: int, op: str, device: bool = False) -> None:
        self.group = group
        self.seq = seq
        self.op = op
        self.device = device  # runs on an accelerator stream: wait() may return before it ends
        self.start = time.monotonic()
        self.works: Sequence[Any] | None = None  # None: still being issued, or synchronous
        self.within: str | None = None  # the collective call that issued it (comm/alone.py)

    def completed(self) -> bool:
        works = self.works
        return works is not None and all(w.is_completed() for w in works)


#: how many of a group's latest collectives a rank keeps, to tell a peer which one it ran
#: under a call number the peer is stuck in (a rank already past it)
RECENT = 16


class _GroupState:
    __slots__ = ("info", "op", "recent", "seq")

    def __init__(self, info: GroupInfo) -> None:
        self.info = info
        self.seq = 0
        self.op = ""
        self.recent: deque[str] = deque(maxlen=RECENT)  # the latest ops, newest last


def _describe(pg: Any) -> GroupInfo:
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
    name = str(getattr(pg, "group_name", "") or "") or f"ranks {compact_ranks(ranks)}"
    if pg is dist.group.WORLD:
        return GroupInfo(name, ranks, "the world group")
    return GroupInfo(name, ranks, f"group {name} (ranks {compact_ranks(ranks)})")


def env_flag(*names: str) -> bool:
    """True when any of the environment variables is set to something other than 0/empty."""
    return any(os.environ.get(n, "").strip().lower() not in ("", "0", "false", "no", "off")
               for n in names)


DEBUG_VARS = ("METADIST_DEBUG", "METADIST_DEBUG_COLLECTIVES")



class Tracker:
    """Per-process collective bookkeeping shared by ``comm`` (writer) and the watchdog."""

    def __init__(self) -> None:
        # Debug mode: cross-check a fingerprint of every collective on every rank first.
        self.debug = env_flag(*DEBUG_VARS)
        self._lock = threading.Lock()
        self._groups: dict[Any, _GroupState] = {}
        self._pending: set[CollectiveCall] = set()
        self.last_active = time.monotonic()  # when a collective last started or finished

    def enter(self, op: str, pg: Any, device: bool = False) -> CollectiveCall:
        """Record that this rank is entering ``op`` on ``pg`` (``device``: on accelerator
        tensors); returns its entry."""
        state = self._groups.get(pg)
        if state is None:
            state = _GroupState(_describe(pg))
            self._groups[pg] = state
        return self._enter(state, op, device)

    def enter_p2p(self, op: str, me: int, peer: int, device: bool = False) -> CollectiveCall:
        """Record that this rank is entering point-to-point ``op`` with global rank ``peer``:
        counted on the pair's own sequence, since the group's other ranks take no part."""
        key = ("p2p", min(me, peer), max(me, peer))
        state = self._groups.get(key)
        if state is None:
            a, b = key[1], key[2]
            state = _GroupState(GroupInfo(f"p2p {a}-{b}", (a, b),
                                          f"the point-to-point pair of ranks {a} and {b}"))
            self._groups[key] = state
        return self._enter(state, op, device)

    def _enter(self, state: _GroupState, op: str, device: bool) -> CollectiveCall:
        with self._lock:
            state.seq += 1
            state.op = op
            state.recent.append(op)
            entry = CollectiveCall(state.info, state.seq, op, device)
            self._pending.add(entry)
        self.last_active = entry.start
        return entry

    def release(self, entry: CollectiveCall) -> None:
        """An async collective was issued: nobody waits on it until its handle is waited."""
        with self._lock:
            self._pending.discard(entry)

    def block(self, entry: CollectiveCall) -> None:
        """The caller now waits on ``entry`` (no-op if it already counts as waiting)."""
        with self._lock:
            if entry not in self._pending:
                entry.start = time.monotonic()
                self._pending.add(entry)

    def exit(self, entry: CollectiveCall, works: Sequence[Any] = ()) -> None:
        """The caller is done with ``entry``. On an accelerator, works that are not complete
        yet (NCCL's wait only orders streams) stay watched until the device finishes them.

        On the CPU a returned ``wait()`` is completion, and ``is_completed()`` is not asked:
        gloo's reduce_scatter_tensor returns a work that reports False forever after its wait,
        and trusting it left an entry "waiting" that stopped a healthy job a timeout later.
        """
        self.last_active = time.monotonic()
        if entry.device and works and not all(w.is_completed() for w in works):
            entry.works = list(works)
            return
        with self._lock:
            self._pending.discard(entry)

    def discard(self, entry: CollectiveCall) -> None:
        with self._lock:
            self._pending.discard(entry)

    def waiting(self) -> list[CollectiveCall]:
        """Entries somebody is blocked on, oldest first (those whose device work finished
        after the wait returned are dropped)."""
        with self._lock:
            pending = list(self._pending)
        done = [e for e in pending if e.completed()]
        if done:
            with self._lock:
                self._pending.difference_update(done)
        return sorted((e for e in pending if not e.completed()), key=lambda e: e.start)

    def progress(self) -> list[tuple[GroupInfo, int, str, tuple[str, ...]]]:
        """``(group, last sequence number entered, its op, the latest ops entered, newest
        last)`` for every group used so far."""
        with self._lock:
            return [(s.info, s.seq, s.op, tuple(s.recent)) for s in self._groups.values()
                    if s.seq]

    def seq(self, pg: Any) -> int:
        """How many collectives this process has entered on ``pg``."""
        state = self._groups.get(pg)
        return 0 if state is None else state.seq

    def reset(self) -> None:
        """Forget every group (after shutdown, or in a forked child)."""
        with self._lock:
            self._groups.clear()
            self._pending.clear()


TRACKER = Tracker()
"""The process-wide tracker; ``comm`` writes it, the watchdog reads it."""


def configure_debug(debug: bool | None) -> None:
    """``init(debug=...)``: an explicit choice wins, else ``$METADIST_DEBUG`` turns it on, else
    the current setting (e.g. from ``comm.set_debug``) stays."""
    if debug is not None:
        TRACKER.debug = bool(debug)
    elif env_flag(*DEBUG_VARS):
        TRACKER.debug = True
