"""The waitable result every collective returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from metadist.runtime import watchdog
from metadist.runtime.tracker import TRACKER, CollectiveCall


class Handle:
    """A waitable result of a collective. ``wait()`` returns the result and is idempotent.

    A handle issued by ``comm`` carries its tracker entry: the watchdog sees the collective
    as in flight until ``wait()`` returns, and an error from the backend is explained (which
    op, which call, which ranks are missing) before it is raised.
    """

    def __init__(self, result: Any, works: Sequence[Any] = (),
                 finish: Callable[[], None] | None = None,
                 entry: CollectiveCall | None = None) -> None:
        self._result = result
        self._works = list(works)
        self._finish = finish
        self._entry = entry
        self._done = not self._works and finish is None and entry is None

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        if not self._done:
            if self._entry is not None:
                TRACKER.block(self._entry)  # from now on a hang here is the watchdog's
            try:
                for work in self._works:
                    work.wait()
            except BaseException as exc:  # KeyboardInterrupt too: the entry must not linger
                if self._entry is None:
                    raise
                better = watchdog.failed(self._entry, exc)
                if better is exc:
                    raise
                raise better from exc
            if self._finish is not None:
                self._finish()
            if self._entry is not None:
                TRACKER.exit(self._entry, self._works)
            self._works.clear()
            self._done = True
        return self._result
