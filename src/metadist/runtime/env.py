"""Launcher detection: read who we are from the environment a launcher left behind.

Nothing here opens a socket or touches torch.distributed; :func:`detect` is a pure function of
an environment mapping so every launcher can be tested by handing it a dict.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

LAUNCHERS = ("torchrun", "env", "launch", "openmpi", "mpich", "slurm", "single")
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29500


class LaunchEnvError(RuntimeError):
    """The environment describes a distributed job that cannot be joined as it stands."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process about the job it belongs to."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str  # "" when a multi-node job did not say where rank 0 is
    master_port: int
    # torchrun's agent already serves the rendezvous store: workers must join it as clients.
    use_env_init: bool = False
    # torchrun restarts workers against the same store; keys must not leak between attempts.
    attempt: int = 0


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            try:
                return int(value)
            except ValueError as err:
                raise LaunchEnvError(
                    f"environment variable {name}={value!r} is not an integer; "
                    "fix or unset it before starting the job"
                ) from err
    if default is None:
        raise LaunchEnvError(f"none of {', '.join(names)} is set in the environment")
    return default


def _job_port(job_id: str | None) -> int:
    """A port derived from the job id, so two jobs on one host rarely pick the same one."""
    if not job_id:
        return DEFAULT_PORT
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM compressed host list, e.g. ``"gpu[01-03,7],cpu5"``."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


def _slurm_tasks_per_node(spec: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from a spec such as ``"4(x2),3"``."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise LaunchEnvError(f"cannot parse SLURM tasks-per-node spec {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


def _master(env: Mapping[str, str], num_nodes: int, job_id: str | None,
            first_host: str | None = None) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        # One node: the rendezvous never needs to leave the machine, so never bind a public
        # interface the user did not ask for. Several nodes and no host known: leave it empty;
        # detection still answers "who am I" and init() refuses to rendezvous.
        addr = LOOPBACK if num_nodes == 1 else first_host or ""
    return addr, _int(env, "MASTER_PORT", default=_job_port(job_id))


def _from_counts(env: Mapping[str, str], launcher: str, rank: int, world: int, local_rank: int,
                 local_world: int, node_rank: int | None, job_id: str | None,
                 first_host: str | None = None) -> LaunchEnv:
    if not 0 <= rank < world:
        raise LaunchEnvError(f"{launcher}: rank {rank} is outside a world of size {world}")
    local_world = max(1, min(local_world, world))
    num_nodes = max(1, -(-world // local_world))
    node = rank // local_world if node_rank is None else node_rank
    addr, port = _master(env, num_nodes, job_id, first_host)
    return LaunchEnv(launcher, rank, world, local_rank, local_world, node, num_nodes, addr, port)


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", default=world)
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else env.get("METADIST_LAUNCHER", "env")
    node = _int(env, "GROUP_RANK", default=rank // max(local_world, 1))
    base = _from_counts(env, launcher, rank, world, _int(env, "LOCAL_RANK", default=0),
                        local_world, node, None)
    # Under torchrun the agent usually serves the store at MASTER_ADDR:MASTER_PORT and the
    # workers join it as clients; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store
    # per rendezvous round, which `metadist run` uses) it says so and rank 0 serves it.
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "True") != "False"
    num_nodes = _int(env, "GROUP_WORLD_SIZE", default=base.num_nodes)
    return LaunchEnv(base.launcher, rank, world, base.local_rank, base.local_world_size, node,
                     num_nodes, base.master_addr, base.master_port,
                     use_env_init=launcher == "torchrun" and agent_store,
                     attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0))


def _openmpi(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    return _from_counts(
        env, "openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), world,
        _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0),
        _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=world), None,
        env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE"),
    )


def _mpich(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "PMI_SIZE")
    return _from_counts(
        env, "mpich", _int(env, "PMI_RANK"), world,
        _int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK", default=0),
        _int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", default=world), None,
        env.get("PMI_KVSNAME") or env.get("PMI_JOBID"),
    )


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "SLURM_NTASKS")
    node_id = _int(env, "SLURM_NODEID", default=0)
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if "SLURM_NTASKS_PER_NODE" in env:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE")
    elif spec:
        local_world = _slurm_tasks_per_node(spec, node_id)
    else:
        local_world = world
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST"))
    hosts = expand_nodelist(nodelist) if nodelist else []
    base = _from_counts(env, "slurm", _int(env, "SLURM_PROCID"), world,
                        _int(env, "SLURM_LOCALID", default=0), local_world, node_id,
                        env.get("SLURM_JOB_ID"), hosts[0] if hosts else None)
    if hosts and len(hosts) > 1 and "MASTER_ADDR" not in env:
        # Several hosts were allocated: rank 0 lives on the first one.
        return LaunchEnv(base.launcher, base.rank, base.world_size, base.local_rank,
                         base.local_world_size, base.node_rank, max(base.num_nodes, len(hosts)),
                         hosts[0], base.master_port)
    return base


def _single(env: Mapping[str, str]) -> LaunchEnv:
    port = _int(env, "MASTER_PORT", default=DEFAULT_PORT)
    return LaunchEnv("single", 0, 1, 0, 1, 0, 1, LOOPBACK, port)


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Detect the launcher and this process's place in the job.

    Precedence: an explicit ``METADIST_LAUNCHER``; torchrun or any launcher that sets
    ``RANK``/``WORLD_SIZE``; OpenMPI; MPICH/Intel MPI/PMI; SLURM (``srun``); a single process.
    """
    env = os.environ if env is None else env
    forced = env.get("METADIST_LAUNCHER")
    if forced in ("openmpi", "mpich", "slurm", "single", "torchrun"):
        return {"openmpi": _openmpi, "mpich": _mpich, "slurm": _slurm, "single": _single,
                "torchrun": _torchrun}[forced](env)
    if forced not in (None, "", "env", "launch"):
        raise LaunchEnvError(
            f"METADIST_LAUNCHER={forced!r} is not known; choose one of: {', '.join(LAUNCHERS)}"
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _openmpi(env)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _mpich(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        # Processes started by srun. A batch script that runs python directly also carries
        # these variables: start such jobs with srun, or set METADIST_LAUNCHER=single.
        return _slurm(env)
    return _single(env)
