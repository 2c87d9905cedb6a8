"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import metadist


@pytest.fixture(autouse=True)
def _leave_the_world_as_found() -> Iterator[None]:
    """A test that initialises metadist in the pytest process (a world of one) shuts it down
    again, so later tests that expect an uninitialised process are not affected by order."""
    was_initialized = metadist.is_initialized()
    yield
    if not was_initialized and metadist.is_initialized():
        metadist.shutdown()
