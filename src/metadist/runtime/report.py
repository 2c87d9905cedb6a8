"""The report of ``metadist env``: what this process would join, with what, and the
environment variables that decide it. Reads only; opens no socket."""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Mapping

import torch
import torch.distributed as dist

from metadist.runtime import env as launch_env
from metadist.runtime import rendezvous, watchdog
from metadist.runtime.tracker import DEBUG_VARS, env_flag

Section = tuple[str, list[tuple[str, str]]]

# Variables shown one by one, set or not: they decide rendezvous, placement and transport.
_NAMED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
          "GROUP_RANK", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
          "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
# Families shown as the variables that are set, the ones metadist reads first.
_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TORCHELASTIC_", ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")),
    ("OMPI_", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("PMI_", ("PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")),
    ("SLURM_", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
                "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")),
    ("METADIST_", ("METADIST_TIMEOUT", "METADIST_DEBUG", "METADIST_LAUNCHER")),
)
_SHOWN_PER_FAMILY = 8


def _yes(ok: bool, why_not: str = "") -> str:
    return "available" if ok else f"not available{f' ({why_not})' if why_not else ''}"


def _family(env: Mapping[str, str], prefix: str, first: tuple[str, ...]) -> str:
    names = sorted((n for n in env if n.startswith(prefix)),
                   key=lambda n: (n not in first, first.index(n) if n in first else 0, n))
    if not names:
        return "none set"
    shown = ", ".join(f"{n}={env[n]}" for n in names[:_SHOWN_PER_FAMILY])
    more = len(names) - _SHOWN_PER_FAMILY
    return shown + (f" (+{more} more)" if more > 0 else "")


def sections(env: Mapping[str, str] | None = None) -> list[Section]:
    """The report as titled sections of ``(key, value)`` rows."""
    env = os.environ if env is None else env
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    d: launch_env.LaunchEnv | None = None
    try:
        d = launch_env.detect(env)
        launch = [("launcher", d.launcher), ("rank", f"{d.rank} of {d.world_size}"),
                  ("local rank", f"{d.local_rank} of {d.local_world_size}"),
                  ("node", f"{d.node_rank} of {d.num_nodes}"),
                  ("master", f"{d.master_addr or '(unset)'}:{d.master_port}")]
    except launch_env.LaunchEnvError as err:
        launch = [("launcher", f"cannot be detected: {err}")]
    local = d.local_world_size if d else 1
    backend = "nccl" if gpus >= local and gpus > 0 else "gloo"
    if d is not None and d.world_size == 1:
        backend = "none (world of one)"
    nccl_version = "-"
    if dist.is_nccl_available() and torch.version.cuda:
        try:
            nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl_version = "unknown"
    versions = [("metadist", _version()), ("torch", torch.__version__),
                ("python", platform.python_version()),
                ("cuda", torch.version.cuda or "not built with CUDA"),
                ("nccl version", nccl_version)]
    backends = [
        ("gloo", _yes(dist.is_gloo_available(), "torch built without gloo")),
        ("nccl", _yes(dist.is_nccl_available(), "torch built without NCCL")),
        ("mpi", _yes(dist.is_mpi_available(), "torch built without MPI")),
        ("mpirun", shutil.which("mpirun") or "not on PATH"),
        ("srun", shutil.which("srun") or "not on PATH"),
        ("backend (auto)", backend),
    ]
    device = "cpu" if backend != "nccl" else f"cuda:{d.local_rank if d else 0}"
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    devices = [("device", device), ("gpus visible", f"{gpus}" + (f" ({', '.join(names)})"
                                                                if names else "")),
               ("threads", str(torch.get_num_threads())), ("cpus", str(os.cpu_count()))]
    try:
        limit = f"{watchdog.resolve_timeout(None):g} s"
    except ValueError as err:
        limit = f"invalid: {err}"
    lo = rendezvous.loopback_interface() or "none found"
    settings = [("timeout", f"{limit} (rendezvous and each collective; {watchdog.TIMEOUT_VAR})"),
                ("debug", f"{'on' if env_flag(*DEBUG_VARS) else 'off'} (METADIST_DEBUG)"),
                ("loopback", f"{lo} (one-node jobs listen only there)")]
    variables = [(n, env.get(n, "(unset)")) for n in _NAMED]
    variables += [(f"{p}*", _family(env, p, first)) for p, first in _FAMILIES]
    return [("versions", versions), ("launch", launch), ("backends", backends),
            ("device", devices), ("metadist settings", settings), ("environment", variables)]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("metadist")
    except PackageNotFoundError:
        return "unknown (not installed)"


def render(env: Mapping[str, str] | None = None) -> str:
    """The report as text: one ``== title ==`` line per section, aligned ``key  value`` rows."""
    parts = sections(env)
    width = max(len(k) for _, rows in parts for k, _ in rows)
    lines: list[str] = []
    for title, rows in parts:
        lines.append(f"== {title} ==")
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
