"""Misuse a user can trigger gets an error that says what went wrong and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import metadist
from metadist import comm
from metadist.data import distribute_loader
from metadist.errors import RendezvousError
from metadist.runtime import rendezvous
from metadist.runtime.env import detect
from metadist.runtime.spawn import free_port
from metadist.testing import run_on_ranks


def test_optimizer_built_on_another_model() -> None:
    net, other = nn.Linear(3, 2), nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"2 tensor\(s\) in the optimizer are not parameters "
                                         r"of the model passed to setup; build the optimizer"):
        metadist.strategy("single").setup(net, torch.optim.SGD(other.parameters(), lr=0.1))


def test_setup_without_an_optimizer_or_with_something_else() -> None:
    s = metadist.strategy("single")
    with pytest.raises(ValueError, match=r"needs the optimizer; for the module alone call "
                                         r"strategy.setup_module"):
        s.setup(nn.Linear(3, 2))
    with pytest.raises(TypeError, match=r"takes a torch\.optim\.Optimizer, got list"):
        s.setup(nn.Linear(3, 2), [1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["single", "ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_an_optimizer_of_another_kind_says_how_to_set_up(name: str) -> None:
    """zero3 and hsdp read the optimizer's groups first, and failed with "tuple indices
    must be integers or slices, not str" on the TorchOpt drop-in's Optimizer."""
    from metadist.compat import torchopt

    net = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"takes a torch\.optim\.Optimizer, got Adam; .*"
                                        r"strategy\.setup_module\(model\)"):
        metadist.strategy(name).setup(net, torchopt.Adam(net.parameters()))


def test_setup_twice_and_optimizer_before_module() -> None:
    s = metadist.strategy("single")
    net = nn.Linear(3, 2)
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already set up by a strategy; pass the original"):
        s.setup(model, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"needs the module returned by strategy\.setup_module"):
        s.setup_optimizer(net, torch.optim.SGD(net.parameters(), lr=0.1))  # type: ignore[arg-type]


def test_input_on_another_device_than_the_model() -> None:
    model = metadist.strategy("single").setup_module(nn.Linear(3, 2))
    meta_input = torch.empty(4, 3, device="meta")  # a device other than the model's
    with pytest.raises(RuntimeError, match=r"the input is on meta but the model is on cpu; "
                                           r"move batches with x.to\(strategy.device\)"):
        model(meta_input)


def test_unknown_strategy_option_and_precision() -> None:
    with pytest.raises(ValueError, match="strategy 'zer2' is not known; choose one of: single"):
        metadist.strategy("zer2")
    with pytest.raises(ValueError, match="has no option"):
        metadist.strategy("ddp", bucket_mb=3)
    with pytest.raises(ValueError, match="precision 'bf17' is not known; choose one of: 32-true"):
        metadist.strategy("zero3", precision="bf17")
    # Betty's names are aliases of the modes
    assert metadist.strategy("zero3", precision="bf16").config.precision == "bf16-mixed"


@pytest.mark.parametrize(("name", "option", "value", "expected"), [
    ("ddp", "bucket_cap_mb", "big", r"bucket_cap_mb must be a number \(float\), got 'big' of "
                                    r"type str; e\.g\. bucket_cap_mb=25\.0 \(the default\)"),
    ("ddp", "broadcast_buffers", "yes", r"broadcast_buffers must be True or False \(bool\)"),
    ("zero2", "overlap_param_gather", 1, r"overlap_param_gather must be True or False"),
    ("fsdp", "min_unit_params", 1.5, r"min_unit_params must be an integer \(int\), got 1\.5"),
    ("fsdp", "wrap_classes", nn.Linear, r"wrap_classes must be a tuple of nn\.Module classes"),
    ("fsdp", "param_dtype", 16, r"param_dtype must be a string or a torch\.dtype or None"),
    ("single", "sync_batchnorm", "true", r"sync_batchnorm must be True or False"),
    ("single", "precision", 16, r"precision must be a string \(str\), got 16 of type int"),
    ("dp", "reduce_dtype", 2, r"reduce_dtype must be a string or a torch\.dtype or None"),
])
def test_strategy_option_of_the_wrong_type_names_it(name: str, option: str, value: object,
                                                    expected: str) -> None:
    # Used to be a raw TypeError from inside the option's own check ("'<=' not supported
    # between instances of 'str' and 'int'"), or no error at all until setup.
    with pytest.raises(TypeError, match=f"^strategy option {expected}"):
        metadist.strategy(name, **{option: value})


def test_strategy_options_of_the_right_type_pass() -> None:
    assert metadist.strategy("ddp", bucket_cap_mb=50).config.bucket_cap_mb == 50
    s = metadist.strategy("fsdp", wrap_classes=(nn.Linear,), param_dtype=torch.bfloat16,
                          reduce_dtype="float32", min_unit_params=10)
    assert s.config.wrap_classes == (nn.Linear,)


# ----- data loaders that cannot be split by index ------------------------------------------

class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.arange(8.0).unsqueeze(1))


class _NoLength(Dataset[torch.Tensor]):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def test_loaders_whose_dataset_cannot_be_split() -> None:
    stream = DataLoader(_Stream(), batch_size=2)
    with pytest.raises(ValueError, match=r"reads an IterableDataset \(_Stream\), which cannot be "
                                         r"split by index, so every rank would read the same "
                                         r"samples\. Shard it inside the dataset"):
        distribute_loader(stream, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"dataset _NoLength has no __len__, so its samples "
                                         r"cannot be split into per-rank index slices\. Give it "
                                         r"a __len__"):
        distribute_loader(DataLoader(_NoLength(), batch_size=2), rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"dataset_shards_itself=True is for an IterableDataset; "
                                         r"TensorDataset is a map-style dataset"):
        distribute_loader(DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2), rank=0,
                          world_size=2, dataset_shards_itself=True)


def _setup_stream_loader() -> str:
    s = metadist.strategy("ddp")
    try:
        s.setup_dataloader(DataLoader(_Stream(), batch_size=2))
    except ValueError as err:
        message = str(err)
    else:
        message = "no error"
    kept = s.setup_dataloader(DataLoader(_Stream(), batch_size=2), dataset_shards_itself=True)
    assert isinstance(kept.dataset, _Stream)
    return message


def test_strategy_refuses_an_iterable_dataset_unless_it_shards_itself() -> None:
    for message in run_on_ranks(_setup_stream_loader, 2):
        assert "pass setup_dataloader(loader, dataset_shards_itself=True)" in message


# ----- collectives -------------------------------------------------------------------------

def _mixed_devices() -> str:
    out = torch.empty(4)
    try:
        comm.all_gather(out, torch.empty(2, device="meta"))  # a CPU output, another device in
    except ValueError as err:
        return str(err)
    return "no error"


def test_tensors_on_different_devices_in_one_collective() -> None:
    # On a GPU machine tests/test_gpu.py mixes cpu and cuda; "meta" stands in for it here.
    for message in run_on_ranks(_mixed_devices, 2):
        assert message == ("all_gather: tensors are on different devices (cpu, meta); move "
                           "them to one device first")


# ----- processes that disagree about the job they join ---------------------------------------

_JOIN = """
import os
import sys
import time
import torch
import metadist
from metadist import comm
try:
    metadist.init(backend=sys.argv[1], timeout=120)
except metadist.RendezvousError as err:
    print(f"{type(err).__name__}: {err}", flush=True)
    sys.exit(3)
t = torch.ones(1)
comm.all_reduce(t)
print(f"joined, sum {t.item():g}", flush=True)
while len(sys.argv) > 2 and not os.path.exists(sys.argv[2]):  # keep the job (and store) up
    time.sleep(0.05)
metadist.shutdown()
"""


def _join(ranks: list[tuple[int, int, str]], hold: str = "") -> list[tuple[int, str]]:
    """Start one process per ``(RANK, WORLD_SIZE, backend)`` on one rendezvous; their exit
    codes and output, in order. With ``hold``, processes that joined stay until the first
    process has exited (rank 0 hosts the store: a late process must still find it)."""
    port = str(free_port())
    procs = []
    for rank, size, backend in ranks:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC", "OMPI_",
                                    "PMI_", "SLURM_", "METADIST_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", _JOIN, backend,
                                       *([hold] if hold else [])], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    if hold:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        open(hold, "w").close()
    return [(p.wait(timeout=60), p.communicate()[0]) for p in procs]


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)], ids=["rank1-bigger", "rank0-bigger"])
def test_ranks_started_for_different_world_sizes_are_named_at_once(
        sizes: tuple[int, int]) -> None:
    # Named by the handshake, not by a timeout: the expected message below is the
    # handshake's (a timeout says "did not arrive"), and _join's 60 s wait is a hang guard.
    results = _join([(0, sizes[0], "gloo"), (1, sizes[1], "gloo")])
    expected = (f"rank 1 was started for a world of {sizes[1]} ranks but rank 0 for "
                f"{sizes[0]}: every process must get the same WORLD_SIZE")
    for code, out in results:
        assert code == 3, out
        assert "WorldMismatchError" in out and expected in out, out


def test_two_processes_claiming_one_rank(tmp_path: Path) -> None:
    results = _join([(0, 2, "gloo"), (1, 2, "gloo"), (1, 2, "gloo")], str(tmp_path / "done"))
    failed = [out for code, out in results if code != 0]
    assert len(failed) == 1, results
    assert "WorldMismatchError: rank 1 is claimed twice: this process (pid" in failed[0]
    assert "Give each process its own RANK, or give two jobs on one host different " \
           "MASTER_PORTs" in failed[0]
    assert [out.strip() for code, out in results if code == 0] == ["joined, sum 2"] * 2


def test_two_processes_claiming_rank_zero(tmp_path: Path) -> None:
    # Observed before: the second was told "another job is probably using this port".
    results = _join([(0, 2, "gloo"), (0, 2, "gloo"), (1, 2, "gloo")], str(tmp_path / "done"))
    failed = [out for code, out in results if code != 0]
    assert len(failed) == 1, results
    assert "rank 0 is claimed twice: pid" in failed[0], failed[0]
    assert "was given RANK=0 too. Give each process its own RANK" in failed[0]
    assert "another program or job uses this port" not in failed[0]


def test_ranks_that_chose_different_backends() -> None:
    results = _join([(0, 2, "gloo"), (1, 2, "mpi")])
    for code, out in results:
        assert code == 3, out
        assert "rank 1 chose backend 'mpi' but rank 0 chose 'gloo'" in out, out
        assert "pass metadist.init(backend=...) explicitly" in out, out


def test_rank_zero_names_the_ranks_that_never_arrived() -> None:
    detected = detect({"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": str(free_port())})
    with pytest.raises(RendezvousError, match=r"rank 0 waited 1 s at 127\.0\.0\.1:\d+ for the "
                                              r"other 3 rank\(s\) to join, in vain: ranks 1-3 "
                                              r"never arrived"):
        rendezvous.join(detected, "gloo", torch.device("cpu"), 1.0)


def test_model_on_the_meta_device_says_to_materialize_it() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    for name in ("single", "zero3"):
        with pytest.raises(ValueError, match=r"7 parameter\(s\) or buffer\(s\) of the model are "
                                             r"on the meta device .* \(first: '0.weight'\); "
                                             r"materialize them before setup: model.to_empty"):
            metadist.strategy(name).setup(net, torch.optim.SGD(net.parameters(), lr=0.1))


def _shard(strategy: str, optimizer: str) -> str:
    net = nn.Linear(6, 4, bias=optimizer != "Muon")  # torch's Muon takes only matrices
    make = getattr(torch.optim, optimizer)
    try:
        metadist.strategy(strategy).setup(net, make(net.parameters()))
    except ValueError as err:
        return str(err)
    return "no error"


def test_optimizers_that_cannot_step_a_shard() -> None:
    cases = [("zero1", "LBFGS"), ("zero3", "LBFGS"), ("zero2", "Adafactor"),
             ("zero3", "Adafactor"), ("zero3", "Adam"), ("zero2", "Muon"), ("zero3", "Muon"),
             ("hsdp", "Muon"), ("hsdp", "Adafactor")]
    got = run_on_ranks(_shard_all, 2, args=(cases,))[0]
    lbfgs = ("LBFGS cannot be sharded: its line search and curvature pairs read every "
             "parameter at once, and each rank steps only its share of them. Use a replicated "
             "strategy (ddp) for it")
    assert got[:2] == [lbfgs, lbfgs]
    assert got[2] == "no error"  # zero2 gives each rank whole matrices
    assert got[3].startswith("Adafactor cannot step flat slices of parameters (zero3, fsdp, "
                             "hsdp): it factors each matrix's second moment over its rows and "
                             "columns. Use zero1 or zero2")
    assert got[4] == "no error"
    assert got[5] == "no error"
    for muon in got[6:8]:
        assert muon.startswith("Muon cannot step flat slices of parameters (zero3, fsdp, "
                               "hsdp): it orthogonalises each matrix's update as a whole. Use "
                               "zero1 or zero2"), muon
    assert got[8] == got[3]


def _shard_all(cases: list[tuple[str, str]]) -> list[str]:
    return [_shard(s, o) for s, o in cases]


def test_metadist_run_checks_its_arguments_before_starting_workers() -> None:
    for args, expected in ((["--nproc", "2", "no_such_script.py"],
                            "metadist run: script 'no_such_script.py' does not exist"),
                           (["--nproc", "0", __file__], "--nproc must be at least 1, got 0")):
        proc = subprocess.run([sys.executable, "-m", "metadist", "run", *args],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2
        assert expected in proc.stderr
        assert "torch.distributed" not in proc.stderr  # refused before any worker started


def _single_on_two_ranks() -> str:
    net = nn.Linear(3, 2)
    try:
        metadist.strategy("single").setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    except ValueError as err:
        return str(err)
    return "no error"


def test_single_under_a_multi_process_launch() -> None:
    for message in run_on_ranks(_single_on_two_ranks, 2):
        assert message.startswith("strategy 'single' runs one process, but this job has 2 "
                                  "ranks: each would train its own copy of the model without "
                                  "ever syncing. Use a distributed strategy")
        assert "METADIST_LAUNCHER=single" in message


def _convert_after_setup(strategy: str) -> dict[str, object]:
    """``model.double()`` after setup, then ``model.to('cpu')`` and a training step."""
    options = {"wrap_classes": (nn.Linear,)} if strategy == "zero3" else {}
    s = metadist.strategy(strategy, **options)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.1))
    try:
        model.double()
        refusal = ""
    except RuntimeError as e:
        refusal = str(e)
    model.to("cpu")
    dtype = next(iter(model.full_parameters().values())).dtype
    s.backward(model(torch.randn(2, 4, dtype=dtype)).square().sum())
    opt.step()
    return {"refusal": refusal, "dtypes": {p.dtype for p in model.full_parameters().values()}}


@pytest.mark.parametrize(("strategy", "n"), [("ddp", 2), ("zero1", 2), ("zero2", 2),
                                             ("zero3", 2), ("zero3", 1), ("ddp", 1)])
def test_a_dtype_conversion_after_setup_stops_where_the_strategy_cannot_follow(
        strategy: str, n: int) -> None:
    """Before: the conversion ran and the next backward failed with an unrelated message
    (a gradient dtype mismatch in the buckets, a matmul of float64 by float32). Where the
    strategy keeps no state built for the dtype (ddp on one rank: no buckets) it converts
    as a plain module does."""
    for got in run_on_ranks(_convert_after_setup, n, args=(strategy,)):
        if strategy == "ddp" and n == 1:
            assert got == {"refusal": "", "dtypes": {torch.float64}}, got
            continue
        assert "after setup is not supported" in str(got["refusal"]) \
            and "before setup" in str(got["refusal"]), got
        assert got["dtypes"] == {torch.float32}, got  # nothing changed; training goes on
