"""Two hosts on one machine: network namespaces joined by a veth pair, each with a private
address that exists only inside it, for real multi-node jobs in the suite.

Each namespace also gets its own /etc/hosts (``ip netns exec`` mounts /etc/netns/NAME/hosts
over it) mapping this machine's host name to 127.0.0.1, so the loopback-resolving host name
of the misconfigured case is the same on every machine the suite runs on.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

IFNAME = "mdnet0"  # the same interface name inside both namespaces
_SUBNET = "10.213.{}.{}"


@dataclass(frozen=True)
class Host:
    """One namespace: its name and its address on the veth link."""

    netns: str
    addr: str

    def start(self, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
        """``argv`` run inside this host, in its own session (so a bounded wait can kill the
        whole process tree)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def link_down(self) -> None:
        """Cut this host's end of the link (a network partition; nothing is closed)."""
        _must("-n", self.netns, "link", "set", IFNAME, "down")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=False)


def _must(*args: str) -> None:
    proc = _ip(*args)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces with a veth link between them; removed on exit. Skips the test when
    this machine does not permit network namespaces (not Linux, no `ip`, no privilege)."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        pytest.skip("network namespaces need Linux and iproute2's `ip`")
    tag = f"md{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    probe = _ip("netns", "add", names[0])
    if probe.returncode != 0:
        pytest.skip(f"network namespaces are not permitted here: {probe.stderr.strip()}")
    octet = os.getpid() % 250 + 1
    hosts = tuple(Host(name, _SUBNET.format(octet, i + 1)) for i, name in enumerate(names))
    try:
        _must("netns", "add", names[1])
        _must("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
        for host, end in zip(hosts, (f"{tag}x", f"{tag}y"), strict=True):
            _must("link", "set", end, "netns", host.netns)
            _must("-n", host.netns, "link", "set", end, "name", IFNAME)
            _must("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
            _must("-n", host.netns, "link", "set", IFNAME, "up")
            _must("-n", host.netns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.0.1 {socket.gethostname()}\n")
        yield hosts[0], hosts[1]
    finally:
        for name in names:  # deleting a namespace deletes its end of the veth pair too
            _ip("netns", "del", name)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def finish(procs: Sequence[subprocess.Popen[str]], bound: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process; one still running ``bound`` seconds from
    now is killed with its whole session (exit code -9, and stderr says so)."""
    deadline = time.monotonic() + bound
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[test] killed: still running after {bound:g} s"
        results.append((proc.returncode, out, err))
    return results
