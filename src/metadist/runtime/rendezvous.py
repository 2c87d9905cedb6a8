"""Form the default process group under a timeout, and open the watchdog's store client.

metadist builds the TCP store itself instead of handing ``tcp://`` to torch, for three reasons:
the rendezvous gets the init timeout while the process group gets a later backstop (so the
watchdog's message wins, see ``watchdog.backstop``); failures become errors that say which
ranks are missing and what to do; and on one machine the store listens on loopback only
(torch's binds every interface), with gloo pinned to the loopback interface too.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from metadist.errors import RendezvousError
from metadist.runtime import env as launch_env
from metadist.runtime import handshake
from metadist.runtime.progress import Progress
from metadist.runtime.watchdog import TIMEOUT_VAR, backstop

_STORE_TIMEOUT_S = 5.0  # the watchdog client's own limit per store operation


def is_loopback(addr: str) -> bool:
    """True when every address ``addr`` resolves to is a loopback one: ``127.x``, ``::1``,
    and names such as ``localhost`` (torchrun's ``--standalone`` uses that name)."""
    try:
        infos = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback
                               for info in infos)


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _listener(addr: str, port: int) -> int:
    """A listening socket on ``addr:port`` only, handed to the store as a file descriptor."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        other = _rank_zero_at(addr, port) if exc.errno == errno.EADDRINUSE else None
        if other is not None:
            raise RendezvousError(
                f"rank 0 is claimed twice: {other.where()} already serves the store of a "
                f"job of {other.world_size} ranks at {addr}:{port} as rank 0, and this process "
                f"(pid {os.getpid()}) was given RANK=0 too. Give each process its own RANK, "
                "or give two jobs on one host different MASTER_PORTs") from exc
        raise RendezvousError(
            f"rank 0 cannot listen on {addr}:{port} ({exc.strerror or exc}): another program "
            "or job uses this port: set MASTER_PORT to a free port") from exc
    return sock.detach()


def _rank_zero_at(addr: str, port: int) -> handshake.Claim | None:
    """The claim of the rank 0 whose store listens at ``addr:port``, if it is metadist's."""
    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            addr, port, None, False, timeout=datetime.timedelta(seconds=2),
            wait_for_workers=False)
        key = "metadist/hello/0"
        # it may have bound the port a moment before writing its claim
        client.wait([key], datetime.timedelta(seconds=2))
        return handshake.Claim.decode(client.get(key))
    except Exception:  # not a store, or not metadist's: only the port is known to be taken
        return None


def _store(detected: launch_env.LaunchEnv, timeout: float) -> Any:
    addr, port, n = detected.master_addr, detected.master_port, detected.world_size
    limit = datetime.timedelta(seconds=timeout)
    master = detected.rank == 0 and not detected.use_env_init
    fd = _listener(addr, port) if master and is_loopback(addr) else None
    inode = os.fstat(fd).st_ino if fd is not None else None
    try:
        # The handshake waits for the workers instead of the store, so that a rank started
        # for another world size is named at once rather than after the timeout.
        return dist.TCPStore(  # type: ignore[attr-defined]
            addr, port, n, master, timeout=limit, wait_for_workers=False,
            multi_tenant=fd is None, master_listen_fd=fd)
    except Exception as exc:
        # The failed store may have closed the socket already, and the number been reused:
        # close it only if it is still ours.
        if fd is not None:
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == inode:
                    os.close(fd)
        if master:
            raise RendezvousError(
                f"rank 0 could not start the rendezvous store at {addr}:{port} ({exc}); "
                "another job is probably using this port: set MASTER_PORT to a free port"
            ) from exc
        raise RendezvousError(
            f"rank {detected.rank} could not reach the rendezvous at {addr}:{port} within "
            f"{timeout:g} s ({exc}). Check that rank 0 is running, that every rank has the same "
            "MASTER_ADDR/MASTER_PORT, and that no firewall blocks the port") from exc


FORM_MARGIN_S = 10.0
"""Seconds past its limit that forming the process group may take before the rank stops
(gloo's connection retries can otherwise stretch a 25 s limit to minutes)."""


def name_resolution_hint(detected: launch_env.LaunchEnv, backend: str) -> str:
    """Why gloo cannot connect the nodes, when this host's name resolves to a loopback
    address on a multi-node job and ``GLOO_SOCKET_IFNAME`` does not say where to listen
    (gloo then listens where no other node can reach it); "" otherwise."""
    if (backend != "gloo" or detected.num_nodes < 2 or os.environ.get("GLOO_SOCKET_IFNAME")
            or is_loopback(detected.master_addr)):
        return ""
    host = socket.gethostname()
    if not is_loopback(host):
        return ""
    return (f"this host's name {host!r} resolves to a loopback address, so gloo listens where "
            f"the other nodes of this {detected.num_nodes}-node job cannot connect: set "
            "GLOO_SOCKET_IFNAME to the network interface that reaches them (e.g. "
            "GLOO_SOCKET_IFNAME=eth0; `ip -br addr` lists them) on every node, or map the host "
            "name to its network address in /etc/hosts")


def _stop_process(message: str) -> None:
    from metadist.runtime import watchdog

    watchdog.report_and_exit(RendezvousError.__name__, message)


def form_group(create: Callable[[], None], limit: float, failure: Callable[[float, str], str],
               on_expiry: Callable[[str], None] = _stop_process,
               margin: float = FORM_MARGIN_S) -> None:
    """Run ``create`` (``init_process_group``); if it fails, raise a RendezvousError whose
    message (``failure(seconds waited, note)``) states the real wait. If it has not returned
    ``margin`` seconds past ``limit``, ``on_expiry`` gets that message: by default it is
    printed and the process exits (a thread blocked in gloo cannot be interrupted)."""
    done = threading.Event()
    start = time.monotonic()
    bound = limit + margin

    def expire() -> None:
        if not done.wait(bound):
            on_expiry(failure(time.monotonic() - start,
                              f"; stopped at the limit plus a {margin:g} s margin"))

    threading.Thread(target=expire, name="metadist-rendezvous-limit", daemon=True).start()
    try:
        create()
    except Exception as exc:
        cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(failure(time.monotonic() - start, f"; {cause}")) from exc
    finally:
        done.set()


def join(detected: launch_env.LaunchEnv, backend: str, device: torch.device,
         timeout: float, collective_timeout: float | None = None) -> Progress:
    """``init_process_group`` for ``detected`` within ``timeout`` seconds; returns the
    watchdog's view of the store. The process group's own limit is a backstop behind the
    watchdog's ``collective_timeout`` (default: ``timeout``)."""
    store = _store(detected, timeout)
    if detected.use_env_init:
        # torchrun's agent keeps its store across worker restarts, so a prefix per attempt
        # stops a restarted rank from reading the previous attempt's gloo addresses.
        prefix = f"metadist/attempt{detected.attempt}"
        pg_store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    else:
        prefix = "metadist"
        pg_store = dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]
    where = f"{detected.master_addr}:{detected.master_port}"
    handshake.check(dist.PrefixStore(f"{prefix}/hello", store),  # type: ignore[attr-defined]
                    handshake.Claim.here(detected.rank, detected.world_size, backend,
                                         detected.launcher), timeout, where)
    lo = loopback_interface()
    if backend == "gloo" and is_loopback(detected.master_addr) and lo is not None:
        # One machine: gloo would otherwise listen on whatever the host name resolves to,
        # often a public interface. Set before any group is created; later groups read it too.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    limit = backstop(collective_timeout or timeout)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=limit)}
    if backend == "nccl":
        kwargs["device_id"] = device
    hint = name_resolution_hint(detected, backend)
    if hint:
        os.write(2, f"[rank {detected.rank}] metadist warning: {hint}\n".encode())

    def failure(waited: float, cause: str) -> str:
        # A limit reached, or an error raised well before it (gloo gives up on an address
        # it cannot reach): the message must not call an immediate failure a wait.
        how = (f"it gave up after waiting {waited:.1f} s (limit {timeout:g} s{cause})"
               if waited >= 0.9 * timeout else
               f"it failed after {waited:.1f} s, before its limit of {timeout:g} s "
               f"({cause.lstrip('; ')})")
        return (f"rank {detected.rank} reached the rendezvous at {detected.master_addr}:"
                f"{detected.master_port} but the {backend} process group of "
                f"{detected.world_size} ranks did not form: {how}; "
                + (hint if hint else "a rank stopped or hung while joining: check the other "
                   f"ranks' output, or raise {TIMEOUT_VAR}"))

    form_group(lambda: dist.init_process_group(store=pg_store, rank=detected.rank,
                                               world_size=detected.world_size, **kwargs),
               timeout, failure)  # the start-up limit: the group's own is only a backstop
    return Progress(_watch_client(detected, prefix), where, detected.master_addr,
                    detected.master_port, host_rank=None if detected.use_env_init else 0)


def _watch_client(detected: launch_env.LaunchEnv, prefix: str) -> Any | None:
    """A second connection to the store for the watchdog: its own short timeout, and never
    queued behind a blocking operation of the training thread."""
    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            detected.master_addr, detected.master_port, None, False,
            timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S), wait_for_workers=False)
    except Exception:
        return None
    return dist.PrefixStore(f"{prefix}/watchdog", client)  # type: ignore[attr-defined]


def adopted_progress() -> Progress:
    """The watchdog's store for a process group the user created (torch's default store)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        store = get() if get is not None else None
    except Exception:
        store = None
    if store is None:
        return Progress(None, "the user's process group store")
    return Progress(dist.PrefixStore("metadist/watchdog", store),  # type: ignore[attr-defined]
                    "the user's process group store")
