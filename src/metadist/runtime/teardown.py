"""``metadist run``'s teardown of its workers, within the job's time budget.

Once a worker has failed, torch's elastic agent sends the others SIGTERM and waits up to 30 s
before SIGKILL. A stopped (SIGSTOP, a debugger) or hung worker ignores SIGTERM, so the job
would end 30 s after it was known to have failed, and the summary would blame an unknown
killer. Here the agent waits :data:`GRACE_S` (a worker ending cleanly needs far less), and
the workers it had to kill are remembered so the summary says who killed them and why.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL for a worker that does not end."""


@contextmanager
def bounded_teardown(grace: float = GRACE_S) -> Iterator[set[int]]:
    """While inside, torch elastic's process contexts wait at most ``grace`` seconds after
    SIGTERM; yields the set of worker pids that then had to be killed (filled as it
    happens)."""
    from torch.distributed.elastic.multiprocessing import api

    killed: set[int] = set()
    original = api.PContext.close

    def close(self: Any, death_sig: signal.Signals | None = None, timeout: float = 30) -> None:
        handlers = list(getattr(self, "subprocess_handlers", {}).values())
        alive = {h.proc.pid for h in handlers if h.proc.poll() is None}
        original(self, death_sig, min(timeout, grace))  # type: ignore[arg-type]
        killed.update(h.proc.pid for h in handlers
                      if h.proc.pid in alive and h.proc.returncode == -signal.SIGKILL)

    api.PContext.close = close  # type: ignore[method-assign]
    try:
        yield killed
    finally:
        api.PContext.close = original  # type: ignore[method-assign]
