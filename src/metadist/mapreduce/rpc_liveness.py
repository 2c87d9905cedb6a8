"""The rpc engine's shutdown, bounded by liveness rather than by duration.

Under TorchOpt's layout rank 0 drives and the other ranks serve its calls: they reach the
shutdown at once and wait there for as long as rank 0 trains, so no fixed limit fits that
wait. What must not happen is waiting for a worker that can no longer come: stopped
(SIGSTOP, a debugger), frozen, dead or cut off. So every rank beats a heartbeat into the
job's store while RPC runs, and at the shutdown each rank announces that it arrived and
waits for the others only while their heartbeats keep coming: a worker silent for the job's
limit (``METADIST_TIMEOUT``) is named, and the shutdown fails instead of waiting forever.
Once every worker has arrived torch's graceful shutdown runs, itself within the limit.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from metadist.runtime.bounded_store import BoundedStore, StoreLostError

BEAT_S = 1.0  # seconds between heartbeats
_POLL_S = 0.05


class SilentWorkersError(Exception):
    """Ranks that had not arrived at the shutdown and sent no heartbeat for the limit."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(ranks)
        self.ranks = ranks


class Liveness:
    """One RPC session's heartbeat (a daemon thread) and its shutdown's arrival protocol."""

    def __init__(self, store: BoundedStore, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="metadist-rpc-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        count = 0
        key = f"alive/{self.rank}"
        while not self._stop.is_set():
            count += 1
            value = str(count)
            try:
                self.store.call(lambda s: s.set(key, value))  # noqa: B023 (waited for here)
            except StoreLostError:
                return  # the waiters see the silence; nothing more to do here
            self._stop.wait(BEAT_S)

    def close(self) -> None:
        self._stop.set()

    def wait_all_arrived(self, limit: float) -> None:
        """Announce this rank's arrival at the shutdown, then wait until every rank has
        arrived; raises naming the ranks whose heartbeat stopped for ``limit`` seconds (or
        the store, if it is lost) instead of waiting for them forever."""
        self.store.call(lambda s: s.set(f"arrived/{self.rank}", "1"))
        others = [r for r in range(self.world_size) if r != self.rank]
        last_seen: dict[int, tuple[bytes, float]] = {}
        while True:
            now = time.monotonic()
            missing = self.store.call(lambda s: [r for r in others
                                                 if not s.check([f"arrived/{r}"])])
            if not missing:
                return
            silent = []
            for r in missing:
                beat = self.store.call(lambda s: _beat_of(s, r))  # noqa: B023 (waited for here)
                seen = last_seen.get(r)
                if seen is None or seen[0] != beat:
                    last_seen[r] = (beat, now)
                elif now - seen[1] >= limit:
                    silent.append(r)
            if silent:
                raise SilentWorkersError(silent)
            time.sleep(_POLL_S)


def _beat_of(store: Any, rank: int) -> bytes:
    key = f"alive/{rank}"
    out: bytes = store.get(key) if store.check([key]) else b""
    return out


def start(store: Any, host: str | None, port: int | None, rank: int,
          world_size: int) -> Liveness:
    return Liveness(BoundedStore(store, host, port), rank, world_size)
