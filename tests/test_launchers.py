"""Real launchers: `metadist run` (torchrun underneath), mpirun, a two-node job on loopback,
and SLURM/MPICH detection through their variables with real rendezvous."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from metadist.runtime.spawn import free_port

SCRIPTS = Path(__file__).parent / "scripts"
ALLREDUCE = str(SCRIPTS / "allreduce.py")
pytestmark = pytest.mark.launcher


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "OMPI_",
                                "PMI", "SLURM_", "TORCHELASTIC_", "METADIST_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _metadist(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metadist", *args], capture_output=True,
                          text=True, timeout=timeout, env=_clean_env(**env), check=False)


def _results(stdout: str) -> dict[int, dict[str, str]]:
    rows = {}
    for line in re.findall(r"rank=\d+ world=\S+ node=\S+ local=\S+ launcher=\S+ result=\d+",
                           stdout):
        fields = dict(item.split("=", 1) for item in line.split())
        rows[int(fields["rank"])] = fields
    return rows


def test_metadist_run_two_processes_all_reduce() -> None:
    proc = _metadist("run", "--nproc", "2", ALLREDUCE)
    assert proc.returncode == 0, proc.stderr
    rows = _results(proc.stdout)
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert (row["result"], row["world"], row["launcher"]) == ("3", "2", "torchrun")


def test_metadist_run_reports_the_failing_workers_traceback() -> None:
    proc = _metadist("run", "--nproc", "2", str(SCRIPTS / "fail_first_attempt.py"),
                     ALWAYS_FAIL="1")
    assert proc.returncode == 1
    assert "fail_first_attempt.py failed" in proc.stderr
    assert "ValueError: deliberate failure on rank 1" in proc.stderr
    assert re.search(r"rank\s*:\s*1", proc.stderr)


def test_metadist_run_restarts_failed_workers() -> None:
    proc = _metadist("run", "--nproc", "2", "--max-restarts", "1",
                     str(SCRIPTS / "fail_first_attempt.py"))
    assert proc.returncode == 0, proc.stderr
    assert "rank=0 survived attempt=1" in proc.stdout and "rank=1 survived attempt=1" in proc.stdout


def test_two_nodes_on_loopback_rendezvous_for_real() -> None:
    port = str(free_port())
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "metadist", "run", "--nproc", "1", "--nnodes", "2",
         "--node-rank", str(i), "--master-addr", "127.0.0.1", "--master-port", port, ALLREDUCE],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env())
        for i in range(2)]
    outs = [node.communicate(timeout=120) for node in nodes]
    for node, (_, err) in zip(nodes, outs, strict=True):
        assert node.returncode == 0, err
    rows = {**_results(outs[0][0]), **_results(outs[1][0])}
    assert sorted(rows) == [0, 1]
    for rank, row in rows.items():
        assert row["node"] == f"{rank}/2" and row["result"] == "3"


def test_elastic_job_on_one_node_starts_after_the_last_call() -> None:
    # MIN:MAX once meant a static rendezvous waiting for MAX nodes forever.
    # A rendezvous waiting for the second node would run into the subprocess limit.
    proc = _metadist("run", "--nproc", "1", "--nnodes", "1:2", "--master-port", str(free_port()),
                     "--last-call", "1", ALLREDUCE, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert _results(proc.stdout)[0]["world"] == "1"


def test_a_node_range_that_cannot_be_is_refused_before_any_worker_starts() -> None:
    proc = _metadist("run", "--nnodes", "3:2", ALLREDUCE, timeout=60)
    assert proc.returncode == 2
    assert "--nnodes '3:2' is not a number of nodes or a range MIN:MAX" in proc.stderr


def _elastic_node(port: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "metadist", "run", "--nproc", "1", "--nnodes", "1:2",
         "--master-addr", "127.0.0.1", "--master-port", port, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env())


def _world_of_two(nodes: list[subprocess.Popen[str]]) -> None:
    outs = [node.communicate(timeout=120) for node in nodes]
    for node, (_, err) in zip(nodes, outs, strict=True):
        assert node.returncode == 0, err
    rows = {**_results(outs[0][0]), **_results(outs[1][0])}
    assert sorted(rows) == [0, 1]
    for row in rows.values():  # node ranks follow the joining order, not --node-rank
        assert (row["world"], row["result"], row["launcher"]) == ("2", "3", "torchrun")
    assert sorted(row["node"] for row in rows.values()) == ["0/2", "1/2"]


def test_two_elastic_nodes_on_loopback_form_one_world() -> None:
    port = str(free_port())
    # Both join within the last call (the rendezvous closes as soon as MAX nodes are in).
    _world_of_two([_elastic_node(port, "--node-rank", str(i), ALLREDUCE) for i in range(2)])


def test_a_node_joining_a_running_elastic_job_restarts_it_larger() -> None:
    port, script = str(free_port()), str(SCRIPTS / "grow_world.py")
    first = _elastic_node(port, "--last-call", "1", script)
    assert first.stdout is not None
    line = first.stdout.readline()  # its world of one is running
    assert "world=1" in line, line + first.communicate(timeout=30)[1]
    _world_of_two([first, _elastic_node(port, "--last-call", "1", script)])


def test_mpirun_two_processes() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun is missing: run the README's set-up (it installs Debian's openmpi-bin)")
    proc = subprocess.run(
        [mpirun, "-np", "2", "--allow-run-as-root", "--oversubscribe", "-x", "PATH",
         sys.executable, ALLREDUCE],
        capture_output=True, text=True, timeout=120, env=_clean_env(), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _results(proc.stdout)
    assert sorted(rows) == [0, 1]
    assert all(r["result"] == "3" and r["launcher"] == "openmpi" for r in rows.values())


def _start_ranks(envs: list[dict[str, str]]) -> dict[int, dict[str, str]]:
    procs = [subprocess.Popen([sys.executable, ALLREDUCE], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_clean_env(**e))
             for e in envs]
    rows: dict[int, dict[str, str]] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        rows.update(_results(out))
    return rows


def test_slurm_variables_are_enough_to_rendezvous() -> None:
    port = str(free_port())
    rows = _start_ranks([
        {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
         "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS_PER_NODE": "2",
         "SLURM_JOB_ID": "77", "MASTER_PORT": port}
        for r in range(2)])
    assert all(r["launcher"] == "slurm" and r["result"] == "3" for r in rows.values())


def test_mpich_pmi_variables_are_enough_to_rendezvous() -> None:
    port = str(free_port())
    rows = _start_ranks([{"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r),
                          "MPI_LOCALNRANKS": "2", "MASTER_PORT": port} for r in range(2)])
    assert all(r["launcher"] == "mpich" and r["result"] == "3" for r in rows.values())


def test_metadist_env_describes_the_process() -> None:
    proc = _metadist("env", RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_PORT="1")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"launcher\s+env", proc.stdout)
    assert re.search(r"rank\s+1 of 4", proc.stdout)
    assert re.search(r"node\s+0 of 2", proc.stdout)
    assert re.search(r"torch\s+\d", proc.stdout)
