"""Each rank's collective progress in the rendezvous store, read only when something is stuck.

Keys, under a per-job prefix:

``g/<group>/r<rank>``  ``"<seq> <op>"``: the last collective this rank entered on the group,
                      then the ops of the ones before it (a line each, newest first), so a
                      rank stuck in an earlier call number can see what this rank ran under
                      it. Written by the watchdog thread once a collective has waited a
                      while, never on the hot path.
``abort``             JSON: the first rank whose collective timed out, and which one.
``reported``          that rank has read everyone's progress, so the others may exit (under
                      ``launch``, mpirun and srun, rank 0's process hosts the store).
``failed``            the first rank whose script raised: it alone prints a full traceback.
``left/r<rank>``      that rank left the job cleanly (``metadist.shutdown`` or the end of its
                      program without an error), after publishing its last collectives.

Only non-blocking store operations are used (set, check, compare_set, get of a key known to
exist), each waited for at most a few seconds (runtime/bounded_store.py: a stopped, frozen
or unreachable store process does not answer at all), so a lost store costs that once:
after the first error the store is treated as gone, and why is kept for the reports.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, TypeVar

from metadist.runtime.bounded_store import BoundedStore, StoreLostError
from metadist.runtime.tracker import CollectiveCall, compact_ranks

T = TypeVar("T")


@dataclass(frozen=True)
class AbortRecord:
    """Rank ``rank`` found ``op #seq`` on group ``group`` past the timeout."""

    rank: int
    group: str
    label: str
    seq: int
    op: str


class Published(NamedTuple):
    """What a rank published for a group: its last call number and op, and the ops it
    entered before that (newest first)."""

    seq: int
    op: str
    before: tuple[str, ...] = ()


def op_at(state: tuple[int, str] | Published, seq: int) -> str | None:
    """The op a rank that published ``state`` entered as call ``seq`` (None: not known)."""
    if seq == state[0]:
        return state[1]
    before = state.before if isinstance(state, Published) else ()
    back = state[0] - seq - 1
    return before[back] if 0 <= back < len(before) else None


class Progress:
    """The store operations of the watchdog protocol, each failing soft."""

    def __init__(self, store: Any | None, where: str, host: str | None = None,
                 port: int | None = None, host_rank: int | None = None) -> None:
        self._store = None if store is None else BoundedStore(store, host, port)
        self.where = where  # "host:port", for messages
        #: the rank whose process hosts the store (0 under metadist run, launch, mpirun and
        #: srun), None when another process does (torch's agent): a lost store names it
        self.host_rank = host_rank
        self.error: str | None = None if store is not None else "no store is available"
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self.error is None

    def _call(self, fn: Callable[[Any], T], default: T) -> T:
        if self._store is None or self.error is not None:
            return default
        try:
            return self._store.call(fn)
        except StoreLostError as exc:  # a lost store: remember why, stop asking
            with self._lock:
                self.error = str(exc)
            return default

    def publish(self, group: str, rank: int, seq: int, op: str,
                before: tuple[str, ...] = ()) -> None:
        text = "\n".join((f"{seq} {op}", *before))
        self._call(lambda s: s.set(f"g/{group}/r{rank}", text), None)

    def read(self, group: str, ranks: tuple[int, ...]) -> dict[int, Published | None] | None:
        """What each rank published on ``group`` (None: nothing published); None when the
        store cannot be read."""
        def get(s: Any) -> dict[int, Published | None]:
            out: dict[int, Published | None] = {}
            for r in ranks:
                key = f"g/{group}/r{r}"
                if s.check([key]):
                    last, *before = s.get(key).decode().split("\n")
                    seq, _, op = last.partition(" ")
                    out[r] = Published(int(seq), op, tuple(before))
                else:
                    out[r] = None
            return out

        return self._call(get, None)

    def claim_abort(self, record: AbortRecord) -> AbortRecord | None:
        """Become the rank that reports (first claim wins); returns the standing record."""
        text = json.dumps(asdict(record))
        got = self._call(lambda s: s.compare_set("abort", "", text), b"")
        return AbortRecord(**json.loads(got)) if got else None

    def abort_record(self) -> AbortRecord | None:
        got = self._call(lambda s: s.get("abort") if s.check(["abort"]) else b"", b"")
        return AbortRecord(**json.loads(got)) if got else None

    def mark_reported(self) -> None:
        self._call(lambda s: s.set("reported", "1"), None)

    def wait_reported(self, limit: float) -> None:
        """Poll (never a blocking wait, which would hold the client) until the reporting
        rank has read the progress keys, at most ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self._call(lambda s: bool(s.check(["reported"])), True):
                return
            time.sleep(0.05)

    def publish_left(self, rank: int) -> None:
        self._call(lambda s: s.set(f"left/r{rank}", "1"), None)

    def wait_left(self, ranks: tuple[int, ...], limit: float) -> None:
        """Poll until ``ranks`` have all left cleanly, at most ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and self.available:
            if len(self.left(ranks)) == len(ranks):
                return
            time.sleep(0.05)

    def left(self, ranks: tuple[int, ...]) -> set[int]:
        """The ranks among ``ranks`` that left the job cleanly (empty when unknown)."""
        return self._call(lambda s: {r for r in ranks if s.check([f"left/r{r}"])}, set())

    def claim_first_failure(self, rank: int) -> bool:
        """True for the first rank to claim it (and when the store cannot tell)."""
        got = self._call(lambda s: s.compare_set("failed", "", str(rank)), b"")
        return not got or got.decode() == str(rank)


def _unpublished(entry: CollectiveCall, me: int, count: int) -> str:
    """Why a rank published no progress: a live rank publishes once it has waited in a
    collective for a while, or when another rank reports, so this one could not."""
    it, was = ("it", "was") if count == 1 else ("they", "were")
    reached = (f"{it} had completed #{entry.seq - 1} or later on this group (every collective "
               f"on it before this one completed on rank {me})" if entry.seq > 1
               else "this is the group's first collective")
    return (f"{it} {was} probably stopped (SIGSTOP, a debugger), frozen (swapping, native code "
            f"holding the GIL), dead (see {'its' if count == 1 else 'their'} output), or cut off "
            f"from this rank and the store by the network (a partition: then "
            f"{'its' if count == 1 else 'their'} own report names the store as unreachable); "
            f"{reached}")


#: point-to-point calls by direction (comm/api.py)
_DIRECTION = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


def _first_difference(mine: tuple[int, str] | Published, theirs: tuple[int, str] | Published,
                      seq: int) -> tuple[int, str, str] | None:
    """The earliest call before ``seq`` that both ranks' kept histories name, and name
    differently (a collective of one call paired with another's of the same kind)."""
    found = None
    for earlier in range(seq - 1, 0, -1):
        a, b = op_at(mine, earlier), op_at(theirs, earlier)
        if a is None or b is None:
            break
        if a != b:
            found = (earlier, a, b)
    return found


def explain(entry: CollectiveCall,
            states: Mapping[int, tuple[int, str] | Published | None] | None, me: int,
            progress: Progress) -> tuple[str, tuple[int, ...]]:
    """Which ranks did not arrive at ``entry`` (or entered something else instead), in words,
    and the missing ranks."""
    if states is None:
        host = progress.host_rank
        if host is not None and host != me and host in entry.group.ranks:
            return (f"rank {host} did not arrive and cannot be asked: the store its process "
                    f"hosts at {progress.where} is lost ({progress.error})"), (host,)
        return (f"this rank lost the store at {progress.where} ({progress.error}), so which "
                "ranks did not arrive cannot be asked"), ()
    behind: dict[tuple[int, str] | None, list[int]] = {}
    diverged: dict[str, list[int]] = {}
    past: dict[tuple[int, str], list[int]] = {}
    gone = progress.left(entry.group.ranks)
    departed: list[int] = []
    parts = []
    for r in entry.group.ranks:
        state = states.get(r)
        if r == me:
            continue
        if r in gone and (state is None or state[0] < entry.seq):
            departed.append(r)
            last = (f"after its #{state[0]} {state[1]} on this group" if state
                    else "without a collective on this group")
            parts.append(f"rank {r} had already left the job {last} (metadist.shutdown, or its "
                         "program ended without an error): its program skipped this collective "
                         "or stopped early")
        elif state is None or state[0] < entry.seq:
            behind.setdefault((state[0], state[1]) if state and state[0] > 0 else None,
                              []).append(r)
        elif (theirs := op_at(state, entry.seq)) is None:  # past it, by more than it kept
            past.setdefault((state[0], state[1]), []).append(r)
        elif entry.op in _DIRECTION:  # point to point: a send pairs with the peer's recv
            if _DIRECTION.get(theirs) == _DIRECTION[entry.op]:
                both = "receive" if _DIRECTION[entry.op] == "recv" else "send"
                parts.append(f"rank {r} is in {theirs} #{entry.seq} too: both ranks {both}, so "
                             "neither call can complete (each send pairs with one recv on the "
                             "peer, in the same order on both ranks)")
        elif theirs != entry.op:
            diverged.setdefault(theirs, []).append(r)
    for state, ranks in sorted(behind.items(), key=lambda kv: kv[1][0]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {compact_ranks(ranks)}"
        if state:
            parts.append(f"{who} did not arrive (last collective on this group: "
                         f"#{state[0]} {state[1]})")
        else:
            parts.append(f"{who} did not arrive and published no progress: "
                         f"{_unpublished(entry, me, len(ranks))}")
    mine = states.get(me)
    for op, ranks in sorted(diverged.items(), key=lambda kv: kv[1][0]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {compact_ranks(ranks)}"
        theirs_state = states.get(ranks[0])
        first = (None if mine is None or theirs_state is None
                 else _first_difference(mine, theirs_state, entry.seq))
        earlier = ("" if first is None else
                   f"; they first paired different calls at #{first[0]}: {first[1]} on this "
                   f"rank, {first[2]} on rank {ranks[0]}")
        parts.append(f"{who} entered {op} as #{entry.seq} instead: the ranks' programs diverged "
                     f"(a skipped, extra or reordered collective{earlier}; METADIST_DEBUG=1 "
                     "stops at the first differing call)")
    for (seq, op), ranks in sorted(past.items(), key=lambda kv: kv[1][0]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {compact_ranks(ranks)}"
        parts.append(f"{who} {'is' if len(ranks) == 1 else 'are'} already past this call (at "
                     f"#{seq} {op}) while it never completed here: the ranks' programs "
                     "diverged (a skipped, extra or reordered collective made them pair "
                     "different calls; METADIST_DEBUG=1 stops at the first differing call)")
    if not parts:
        parts.append("every rank entered it, yet it did not complete (a backend or network "
                     "problem; NCCL_DEBUG=INFO or GLOO_SOCKET_IFNAME may help)")
    missing = departed + [r for ranks in behind.values() for r in ranks]
    return "; ".join(parts), tuple(sorted(missing))
