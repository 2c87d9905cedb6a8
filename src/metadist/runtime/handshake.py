"""Before the process group forms, every rank checks that it joined the same job as the others.

A rank started with another ``WORLD_SIZE``, two processes claiming one rank (a mistyped
``RANK``, two jobs on one ``MASTER_PORT``), or ranks that chose different backends (one node
sees GPUs, another does not) would otherwise make ``init_process_group`` wait out its timeout,
or form a group that hangs at the first collective. So each rank writes what it believes to
the rendezvous store, every rank compares itself with rank 0 (which every view of the job
contains), and rank 0 compares every rank as it arrives. A mismatch is named at once, on the
ranks that see it, with both sides' values and the fix.

Keys, under the rendezvous prefix: ``hello/claims/<rank>`` counts the processes that claimed
the rank, ``hello/<rank>`` holds the claim as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from metadist.errors import RendezvousError, WorldMismatchError
from metadist.runtime.tracker import compact_ranks
from metadist.runtime.watchdog import TIMEOUT_VAR

_POLL_S = 0.02


@dataclass(frozen=True)
class Claim:
    """What one rank believes about the job it is joining."""

    rank: int
    world_size: int
    backend: str
    launcher: str
    host: str
    pid: int
    torch: str

    @classmethod
    def here(cls, rank: int, world_size: int, backend: str, launcher: str) -> Claim:
        return cls(rank, world_size, backend, launcher, socket.gethostname(), os.getpid(),
                   torch.__version__)

    def where(self) -> str:
        return f"pid {self.pid} on {self.host}, started by {self.launcher}"

    @classmethod
    def decode(cls, raw: bytes) -> Claim:
        data = json.loads(raw)
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def _differences(mine: Claim, theirs: Claim) -> list[str]:
    """Why ``mine`` cannot join ``theirs``' job, one sentence per field that matters."""
    out = []
    if mine.world_size != theirs.world_size:
        out.append(
            f"rank {mine.rank} was started for a world of {mine.world_size} ranks but rank "
            f"{theirs.rank} for {theirs.world_size}: every process must get the same "
            "WORLD_SIZE (or -np / --ntasks / --nproc x --nnodes)")
    if mine.backend != theirs.backend:
        out.append(
            f"rank {mine.rank} chose backend {mine.backend!r} but rank {theirs.rank} chose "
            f"{theirs.backend!r} (with backend='auto' this happens when some nodes see a GPU per "
            "local rank and others do not): pass metadist.init(backend=...) explicitly")
    return out


def _raise_mismatch(mine: Claim, theirs: Claim, problems: list[str]) -> None:
    raise WorldMismatchError(
        f"rank {mine.rank} ({mine.where()}) and rank {theirs.rank} ({theirs.where()}) did not "
        f"join the same job: {'; '.join(problems)}.")


def _claim_rank(store: Any, mine: Claim) -> None:
    if int(store.add(f"claims/{mine.rank}", 1)) == 1:
        store.set(str(mine.rank), json.dumps(asdict(mine)))
        return
    other = ""
    if store.check([str(mine.rank)]):
        other = f" by {Claim.decode(store.get(str(mine.rank))).where()}"
    raise WorldMismatchError(
        f"rank {mine.rank} is claimed twice: this process ({mine.where()}) and one already "
        f"joined{other}. Give each process its own RANK, or give two jobs on one host "
        "different MASTER_PORTs.")


def _wait_for(store: Any, rank: int, deadline: float) -> Claim | None:
    key = str(rank)
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)
    return Claim.decode(store.get(key))


def _wait_seen(store: Any, rank: int, deadline: float) -> None:
    """Until ``rank`` has read rank 0's claim (at most until ``deadline``): rank 0 may host
    the store, and leaving at once would cut the other rank off before it names the mismatch."""
    while not store.check([f"seen/{rank}"]) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def check(store: Any, mine: Claim, timeout: float, where: str) -> None:
    """Claim this rank in ``store`` and compare with the others (see the module docstring).

    Raises :class:`WorldMismatchError` naming both ranks and the differing values, or
    :class:`RendezvousError` when rank 0 (for the others) or some rank (for rank 0) never
    arrives within ``timeout`` seconds.
    """
    _claim_rank(store, mine)
    deadline = time.monotonic() + timeout
    if mine.rank != 0:
        root = _wait_for(store, 0, deadline)
        if root is None:
            raise RendezvousError(
                f"rank {mine.rank} reached the rendezvous at {where} but rank 0 did not check "
                f"in within {timeout:g} s; check rank 0's output, or raise {TIMEOUT_VAR} if it "
                "starts slowly")
        problems = _differences(mine, root)
        # Rank 0 hosts the store (under most launchers): tell it this rank has read its claim,
        # so that on a mismatch it stays until this rank can name it too.
        store.set(f"seen/{mine.rank}", "1")
        if problems:
            _raise_mismatch(mine, root, problems)
        return
    missing = set(range(1, mine.world_size))
    while missing:
        for rank in sorted(missing):
            if store.check([str(rank)]):
                missing.discard(rank)
                theirs = Claim.decode(store.get(str(rank)))
                problems = _differences(theirs, mine)
                if problems:
                    _wait_seen(store, rank, deadline)
                    _raise_mismatch(mine, theirs, problems)
        if missing and time.monotonic() >= deadline:
            ranks = sorted(missing)
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {compact_ranks(ranks)}"
            raise RendezvousError(
                f"rank 0 waited {timeout:g} s at {where} for the other {mine.world_size - 1} "
                f"rank(s) to join, in vain: {who} never arrived. Start all {mine.world_size} "
                f"processes with the same MASTER_ADDR and MASTER_PORT, or raise {TIMEOUT_VAR} "
                "if they start slowly")
        if missing:
            time.sleep(_POLL_S)
