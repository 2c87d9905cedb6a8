"""How the Betty drop-in's tests compare: float64 runs of the same operations in another
order agree with Betty in one process to 1e-10 and with their own one process across ranks to
1e-9 (as tests/test_betty_examples.py), and a two-rank peers pool shared by a test module."""

from __future__ import annotations

from collections.abc import Iterator

import torch

import peers

RTOL_BETTY, RTOL_RANKS, ATOL = 1e-10, 1e-9, 1e-12


def assert_states_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        rtol: float) -> None:
    """The same names, every tensor within ``rtol`` (and :data:`ATOL`)."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


def two_rank_pool() -> Iterator[peers.Reopening]:
    """Body of a module-scoped fixture: a two-rank peers pool, closed at the end."""
    pool = peers.Reopening(2, 240.0)
    try:
        yield pool
    finally:
        pool.close()
