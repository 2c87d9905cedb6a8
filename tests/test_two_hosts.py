"""A real two-node job: two network namespaces joined by a veth pair (tests/netns.py), one
`metadist run` node in each, talking over addresses that exist only inside them.

Training across the two hosts must equal the same job on one host, and the common
misconfiguration (the host name resolves to 127.0.0.1 and GLOO_SOCKET_IFNAME is unset, so
gloo listens where the other node cannot reach) must stop both nodes within the start-up
limit plus its stated margin, with a message that says what to set.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metadist.runtime.rendezvous import FORM_MARGIN_S
from metadist.runtime.spawn import free_port
from netns import IFNAME, Host, finish, two_hosts
from parity import assert_tensors_close

TRAIN = str(Path(__file__).parent / "scripts" / "train_nodes.py")
TIMEOUT_S = 10  # METADIST_TIMEOUT for these jobs
START_S = 60  # interpreter and torch start-up on a loaded 2-core machine, per node
pytestmark = pytest.mark.launcher


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "OMPI_",
                                "PMI", "SLURM_", "TORCHELASTIC_", "METADIST_", "GLOO_"))}
    env.update(OMP_NUM_THREADS="1", METADIST_TIMEOUT=str(TIMEOUT_S), **extra)
    return env


def _node(host: Host, rank: int, master: Host, port: int, out: Path,
          env: dict[str, str]) -> subprocess.Popen[str]:
    return host.start([sys.executable, "-m", "metadist", "run", "--nproc", "1", "--nnodes", "2",
                       "--node-rank", str(rank), "--master-addr", master.addr,
                       "--master-port", str(port), TRAIN, "zero3", str(out)], env)


def _one_host(out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "metadist", "run", "--nproc", "2",
                           "--master-port", str(free_port()), TRAIN, "zero3", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr


def test_training_across_two_hosts_equals_one_host(tmp_path: Path) -> None:
    _one_host(tmp_path / "one.pt")
    with two_hosts() as (a, b):
        env = _env(GLOO_SOCKET_IFNAME=IFNAME)
        port = free_port()
        procs = [_node(host, rank, a, port, tmp_path / f"two{rank}.pt", env)
                 for rank, host in enumerate((a, b))]
        results = finish(procs, 180)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"node {rank}:\n{err}"
    want = torch.load(tmp_path / "one.pt")
    assert_tensors_close(torch.load(tmp_path / "two0.pt"), want, where="two hosts")


def test_a_loopback_host_name_stops_both_nodes_within_the_bound(tmp_path: Path) -> None:
    with two_hosts() as (a, b):
        port = free_port()
        procs = [_node(host, rank, a, port, tmp_path / f"x{rank}.pt", _env())
                 for rank, host in enumerate((a, b))]
        # Observed before: one node waited 139 s at METADIST_TIMEOUT=15.
        results = finish(procs, START_S + TIMEOUT_S + FORM_MARGIN_S)
    for rank, (code, _, err) in enumerate(results):
        assert code not in (0, -9), f"node {rank} (exit {code}):\n{err}"
        assert "set GLOO_SOCKET_IFNAME to the network interface" in err, f"node {rank}:\n{err}"
        assert "resolves to a loopback address" in err
        # the limit it kept, or that it failed before it (observed: gloo gives up at once
        # when nothing listens where it looks; the message once called that a 0.0 s wait)
        kept = (rf"gave up after waiting [\d.]+ s \(limit {TIMEOUT_S} s|failed after [\d.]+ s, "
                rf"before its limit of {TIMEOUT_S} s")
        assert re.search(kept, err), f"node {rank}:\n{err}"
        assert "gave up after waiting 0.0 s" not in err
