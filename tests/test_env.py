"""Launcher detection from environment variables (no processes, no sockets)."""

from __future__ import annotations

import pytest

from metadist.runtime.env import LaunchEnvError, detect, expand_nodelist


def test_single_process_is_a_world_of_one() -> None:
    env = detect({})
    assert (env.launcher, env.rank, env.world_size, env.num_nodes) == ("single", 0, 1, 1)
    assert env.master_addr == "127.0.0.1"


def test_torchrun_variables() -> None:
    env = detect({
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "1234",
        "TORCHELASTIC_RUN_ID": "abc",
    })
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.7", 1234)
    assert env.use_env_init


def test_plain_rank_variables_are_not_torchrun() -> None:
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "4000"})
    assert env.launcher == "env" and not env.use_env_init
    assert (env.local_rank, env.local_world_size, env.node_rank) == (0, 2, 0)


def test_openmpi_single_node_defaults_to_loopback() -> None:
    env = detect({
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "OMPI_MCA_ess_base_jobid": "777",
    })
    assert env.launcher == "openmpi" and env.rank == 3 and env.world_size == 4
    assert env.master_addr == "127.0.0.1"
    assert 20000 <= env.master_port < 40000  # derived from the job id


def test_openmpi_multi_node_without_master_is_refused_at_init_not_detection() -> None:
    env = detect({
        "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    })
    assert env.num_nodes == 2 and env.node_rank == 1 and env.master_addr == ""


def test_mpich_and_intel_mpi_variables() -> None:
    env = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                  "MPI_LOCALNRANKS": "2", "MASTER_PORT": "5555"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("mpich", 1, 2, 1)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 5555)


def test_slurm_multi_node_takes_first_host_of_compressed_nodelist() -> None:
    env = detect({
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "node[01-04]", "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_JOB_ID": "4242",
    })
    assert env.launcher == "slurm"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr) == (2, 4, "node01")


def test_slurm_single_node_uses_loopback() -> None:
    env = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                  "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu7", "SLURM_NTASKS_PER_NODE": "2"})
    assert env.master_addr == "127.0.0.1" and env.num_nodes == 1


def test_torchrun_wins_over_slurm_inside_an_allocation() -> None:
    env = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2"})
    assert env.launcher == "env" and env.rank == 1


def test_forced_launcher_and_unknown_one() -> None:
    assert detect({"METADIST_LAUNCHER": "single", "RANK": "1", "WORLD_SIZE": "2"}).world_size == 1
    with pytest.raises(LaunchEnvError, match="choose one of"):
        detect({"METADIST_LAUNCHER": "pbs"})


def test_bad_integer_names_the_variable() -> None:
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE='two'"):
        detect({"RANK": "0", "WORLD_SIZE": "two"})


def test_rank_outside_world_is_an_error() -> None:
    with pytest.raises(LaunchEnvError, match="outside a world"):
        detect({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("a1,b[7,9-10]", ["a1", "b7", "b9", "b10"]),
        ("gpu[008-010]-ib", ["gpu008-ib", "gpu009-ib", "gpu010-ib"]),
        ("single", ["single"]),
    ],
)
def test_expand_nodelist(spec: str, hosts: list[str]) -> None:
    assert expand_nodelist(spec) == hosts
