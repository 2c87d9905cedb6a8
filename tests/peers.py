"""The peer libraries tests compare metadist with: Betty 0.2.1, TorchOpt 0.7.3, higher 0.2.1
and learn2learn 0.2.0, installed by scripts/setup_peers.sh into .peers/ beside the package
(``make test`` runs it). Only the processes that run a peer put it on their path, through
:func:`use`: rank bodies call it first, and run in a pool of their own (:func:`pool`), so no
other test's process ever imports a peer or the torchvision stand-in.

A missing peer is a set-up error, not a reason to skip: the comparison is the test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from metadist.runtime.spawn import RankPool

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
#: import-only torchvision for learn2learn (tests/peer_standins/torchvision)
STANDINS = Path(__file__).resolve().parent / "peer_standins"


def use(*, torchvision_standin: bool = False) -> None:
    """Put .peers/ (and, for learn2learn, the torchvision stand-in) on this process's path."""
    if not any(PEERS.glob(".installed-*")):
        raise RuntimeError(f"the peer libraries are not installed in {PEERS}; run "
                           "scripts/setup_peers.sh (make test does)")
    wanted = [str(PEERS)] + ([str(STANDINS)] if torchvision_standin else [])
    for path in reversed(wanted):
        if path not in sys.path:
            sys.path.insert(0, path)


def quiet_betty() -> None:
    """Betty logs every problem's set-up at INFO: keep a test's output to what matters."""
    import logging

    from betty.logging.logger_base import get_logger

    get_logger().setLevel(logging.WARNING)


@contextmanager
def pool(world_size: int, timeout: float = 300.0,
         nnodes: int = 1) -> Iterator[Callable[..., list[Any]]]:
    """``run(fn, *args)`` on ``world_size`` fresh gloo ranks, closed on exit: peers imported
    there never reach the suite's shared pools. ``nnodes`` splits the ranks into simulated
    nodes (hsdp's node-local and cross-node groups)."""
    ranks = RankPool(world_size, backend="gloo", timeout=timeout, threads=1, nnodes=nnodes)
    try:
        def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
            return ranks.run(fn, args, kwargs, timeout)
        yield run
    finally:
        ranks.close()


def run_on(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = ()) -> list[Any]:
    """One job on a pool of its own."""
    with pool(world_size) as run:
        return run(fn, *args)


class Reopening:
    """A peers pool of ``world_size`` ranks for a whole test module: opened on first use and
    reopened after a job that failed (a failed job closes its pool); :meth:`close` at the
    end."""

    def __init__(self, world_size: int, timeout: float = 300.0, nnodes: int = 1) -> None:
        self.world_size, self.timeout, self.nnodes = world_size, timeout, nnodes
        self._stack: ExitStack | None = None
        self._run: Callable[..., list[Any]] | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if self._run is None:
            self._stack = ExitStack()
            self._run = self._stack.enter_context(
                pool(self.world_size, self.timeout, nnodes=self.nnodes))
        try:
            return self._run(fn, *args)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self._run = None, None


@contextmanager
def layouts(timeout: float) -> Iterator[Callable[[int, int], Reopening]]:
    """``get(world_size, nnodes)``: one :class:`Reopening` pool per layout, for a test
    module's cells; all closed on exit."""
    opened: dict[tuple[int, int], Reopening] = {}

    def get(world_size: int, nnodes: int = 1) -> Reopening:
        if (world_size, nnodes) not in opened:
            opened[(world_size, nnodes)] = Reopening(world_size, timeout, nnodes=nnodes)
        return opened[(world_size, nnodes)]

    try:
        yield get
    finally:
        for pool in opened.values():
            pool.close()
