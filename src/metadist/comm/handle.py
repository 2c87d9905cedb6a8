"""The waitable result every collective returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class Handle:
    """A waitable result of a collective. ``wait()`` returns the result and is idempotent."""

    def __init__(self, result: Any, works: Sequence[Any] = (),
                 finish: Callable[[], None] | None = None) -> None:
        self._result = result
        self._works = list(works)
        self._finish = finish
        self._done = not self._works and finish is None

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        if not self._done:
            for work in self._works:
                work.wait()
            if self._finish is not None:
                self._finish()
            self._works.clear()
            self._done = True
        return self._result
