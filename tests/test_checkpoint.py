"""Checkpoints: reshard on load across strategies, world sizes and formats with parity against
one process; atomic saves; safe, validated, all-or-nothing loads; consolidation; RNG (the
data loader's position: tests/test_checkpoint_loader.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist import cli
from metadist.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    IncompleteCheckpointError,
)
from metadist.checkpoint import sharded as sharded_format
from metadist.checkpoint.atomic import write_atomic
from metadist.testing import run_on_ranks
from parity import (
    assert_parity,
    batches,
    loss_fn,
    make_net,
    make_optimizer,
    shard,
    snapshot,
)

FIRST, THEN = 5, 5  # steps before the checkpoint, steps after resuming
OPTIONS: dict[str, dict[str, Any]] = {
    "zero2": {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0005},
    "zero3": {"min_unit_params": 40},  # every Linear its own unit: many flat shards
    "hsdp": {"min_unit_params": 40},
}
NODES = {("hsdp", 2): 2, ("hsdp", 4): 2}  # hsdp: 2 nodes (x 1 or x 2 ranks)


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def _reference(optimizer: str) -> dict[str, Any]:
    """One process, FIRST + THEN steps on the whole global batch."""
    net = make_net()
    opt = make_optimizer(optimizer, net.parameters())
    sched = _scheduler(opt)
    for x, y in batches(FIRST + THEN):
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        sched.step()
    return snapshot(net, opt)


def _setup(strategy: str, optimizer: str, seed: int = 0) -> tuple[Any, ...]:
    s = metadist.strategy(strategy, sync_batchnorm=True, **OPTIONS.get(strategy, {}))
    net = make_net(seed=seed)
    names = [n for n, _ in net.named_parameters()]
    model, opt = s.setup(net, make_optimizer(optimizer, net.parameters()))
    return s, model, opt, _scheduler(opt), names


def _steps(s: metadist.Strategy, model: Any, opt: torch.optim.Optimizer, sched: Any,
           data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    w = metadist.world()
    for x, y in data:
        opt.zero_grad()
        s.backward(loss_fn(model(shard(x, w.rank, w.world_size)),
                           shard(y, w.rank, w.world_size)))
        opt.step()
        sched.step()


def _train_and_save(strategy: str, optimizer: str, path: str, fmt: str) -> None:
    s, model, opt, sched, _ = _setup(strategy, optimizer)
    _steps(s, model, opt, sched, batches(FIRST + THEN)[:FIRST])
    s.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": FIRST,
                  "note": "hello", "best": torch.tensor([0.25])}, format=fmt)


def _load_and_train(strategy: str, optimizer: str, path: str) -> dict[str, Any]:
    # a different initialisation: the load must overwrite all of it
    s, model, opt, sched, names = _setup(strategy, optimizer, seed=7)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    plain = s.load(path, state)
    assert state["step"] == FIRST and plain["note"] == "hello"
    assert torch.equal(plain["best"], torch.tensor([0.25]))
    _steps(s, model, opt, sched, batches(FIRST + THEN)[FIRST:])
    return snapshot(model, opt, s, names)


def _run(strategy: str, n: int, fn: Any, *args: Any) -> list[Any]:
    return run_on_ranks(fn, n, args=(strategy, *args), nnodes=NODES.get((strategy, n), 1))


RESHARD = [  # (save strategy, ranks, format) -> (load strategy, ranks)
    ("zero3", 2, "sharded", "ddp", 3),
    ("ddp", 3, "sharded", "zero3", 2),
    ("zero1", 3, "sharded", "hsdp", 2),
    ("hsdp", 4, "sharded", "zero2", 3),
    ("zero2", 3, "full", "ddp", 2),
    ("ddp", 2, "full", "zero3", 3),
    ("zero3", 3, "sharded", "zero3", 2),
    # one rank holds every parameter of a unit: their per-parameter values (Adam's step)
    # were saved from one tensor and loaded sharing its storage, stepped once per parameter
    ("zero3", 1, "sharded", "ddp", 2),
    ("single", 1, "sharded", "zero1", 2),
    # with the rows above, every strategy saves and loads each format
    ("zero2", 2, "sharded", "single", 1),
    ("zero3", 2, "full", "hsdp", 4),
    ("hsdp", 2, "full", "zero1", 3),
    ("zero1", 2, "full", "single", 1),
    ("single", 1, "full", "zero2", 2),
]
SAVED = {(saver, fmt) for saver, _, fmt, _, _ in RESHARD}
LOADED = {(loader, fmt) for _, _, fmt, loader, _ in RESHARD}
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "hsdp")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(("saver", "n1", "fmt", "loader", "n2"), RESHARD)
def test_resume_elsewhere_continues_as_if_uninterrupted(
        tmp_path: Path, saver: str, n1: int, fmt: str, loader: str, n2: int,
        optimizer: str) -> None:
    want = _reference(optimizer)
    path = str(tmp_path / "ckpt")
    _run(saver, n1, _train_and_save, optimizer, path, fmt)
    for rank, got in enumerate(_run(loader, n2, _load_and_train, optimizer, path)):
        assert_parity(got, want, f"{saver}x{n1} {fmt} -> {loader}x{n2} rank {rank} {optimizer}")


def test_every_strategy_saves_and_loads_each_format() -> None:
    """What the README claims of RESHARD, kept true as rows change."""
    every = {(s, fmt) for s in STRATEGIES for fmt in ("sharded", "full")}
    assert every - SAVED == set() and every - LOADED == set(), (every - SAVED, every - LOADED)


def test_consolidated_file_loads_everywhere_and_with_plain_torch(tmp_path: Path) -> None:
    sharded_dir, out = tmp_path / "ckpt", tmp_path / "full.pt"
    _run("zero3", 2, _train_and_save, "adam", str(sharded_dir), "sharded")
    # the CLI, in this process: no process group
    assert cli.main(["consolidate", str(sharded_dir), str(out)]) == 0
    plain = torch.load(out, weights_only=True)
    net = make_net()
    net.load_state_dict(plain["model"])  # the model's state dict under its own name
    opt = make_optimizer("adam", net.parameters())
    opt.load_state_dict(plain["optimizer"])  # the plain single-process format
    assert plain["step"] == FIRST and plain["scheduler"]["last_epoch"] == FIRST
    assert len(plain["metadist"]["rng"]) == 2
    want = _reference("adam")
    for got in _run("zero2", 3, _load_and_train, "adam", str(out)):
        assert_parity(got, want, "consolidated -> zero2x3")
    assert cli.main(["consolidate", str(tmp_path / "nothing"), str(out)]) == 1


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(12, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


def _tied(strategy: str, path: str, save: bool) -> dict[str, torch.Tensor]:
    s = metadist.strategy(strategy, **({"min_unit_params": 50} if strategy == "zero3" else {}))
    net = _Tied()
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.1))
    if save:
        opt.zero_grad()
        model(torch.arange(12)).square().mean().backward()
        opt.step()
        s.save(path, {"model": model, "optimizer": opt})
    else:
        s.load(path, {"model": model, "optimizer": opt})
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("saver", "loader"), [("zero3", "ddp"), ("ddp", "zero3")])
def test_tied_weights_reshard(tmp_path: Path, saver: str, loader: str) -> None:
    path = str(tmp_path / "tied")
    saved = run_on_ranks(_tied, 2, args=(saver, path, True))[0]
    for got in run_on_ranks(_tied, 3, args=(loader, path, False)):
        assert got.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(got[k], v), k


# ----- what ranks write ---------------------------------------------------------------------

def _big_model(strategy: str, path: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 4))
    s = metadist.strategy(strategy, **({"min_unit_params": 1000} if strategy == "zero3" else {}))
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.1))
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    s.save(path, {"model": model, "optimizer": opt})


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_each_rank_writes_its_share(tmp_path: Path, strategy: str) -> None:
    path = tmp_path / strategy
    run_on_ranks(_big_model, 2, args=(strategy, str(path)))
    index = json.loads((path / "metadata.json").read_text())
    sizes = [index["files"][f"rank-{r:05d}.bin"]["bytes"] for r in range(2)]
    total = 3 * 4 * (2 * 512 * 513 + 4 * 513)  # parameters + Adam's two moments, fp32
    assert abs(sum(sizes) - total) < 1024, (sizes, total)  # every tensor once
    assert min(sizes) > 0.4 * total, sizes  # spread evenly: writes run in parallel


# ----- atomic saves -------------------------------------------------------------------------

def _save_value(path: str, value: int, crash: str = "") -> str:
    """Save a model and ``value``; ``crash`` simulates a failure on the way."""
    s = metadist.strategy("zero3", min_unit_params=40)
    net = make_net(seed=value)
    model, _ = s.setup(net, make_optimizer("sgd", net.parameters()))
    rank = metadist.world().rank
    original_write, original_commit = sharded_format.write_rank_file, sharded_format.write_atomic

    def half_then_raise(target: Path, slices: Any) -> Any:
        original_write(target, slices)
        with open(target, "r+b") as f:
            f.truncate(f.seek(0, os.SEEK_END) // 2)
        raise OSError("disk full (simulated)")

    def no_commit(target: Path, write: Any) -> None:
        raise OSError("killed before the marker (simulated)")

    if crash == "writer" and rank == 1:
        sharded_format.write_rank_file = half_then_raise
    if crash == "marker" and rank == 0:
        sharded_format.write_atomic = no_commit
    try:
        s.save(path, {"model": model, "value": value})
    except CheckpointError as err:
        return str(err)
    finally:
        sharded_format.write_rank_file, sharded_format.write_atomic = (original_write,
                                                                       original_commit)
    return ""


def _load_value(path: str) -> int:
    s = metadist.strategy("ddp")
    net = make_net(seed=99)
    model, _ = s.setup(net, make_optimizer("sgd", net.parameters()))
    got = s.load(path, {"model": model})["value"]
    assert torch.equal(net.inp.weight, make_net(seed=got).inp.weight)
    return int(got)


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert run_on_ranks(_save_value, 2, args=(path, 1)) == ["", ""]
    for crash in ("writer", "marker"):
        errors = run_on_ranks(_save_value, 2, args=(path, 2, crash))
        assert all(errors), crash  # every rank fails, none hangs
        origin = "rank 1" if crash == "writer" else "rank 0"
        assert all(origin in e and "simulated" in e for e in errors), errors
        assert run_on_ranks(_load_value, 3, args=(path,)) == [1, 1, 1]
    assert run_on_ranks(_save_value, 2, args=(path, 3)) == ["", ""]
    assert run_on_ranks(_load_value, 2, args=(path,)) == [3, 3]
    versions = [p.name for p in Path(path).iterdir() if p.name.startswith("v-")]
    assert len(versions) == 1  # earlier versions and interrupted leftovers are removed


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "file.pt"
    target.write_bytes(b"old")

    def fail(f: Any) -> None:
        f.write(b"partial")
        raise OSError("crash")

    with pytest.raises(OSError, match="crash"):
        write_atomic(target, fail)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["file.pt"]


# ----- safe, validated, all-or-nothing loads ------------------------------------------------

class _Wider(nn.Module):  # the parity Net's names with a wider hidden layer
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 32)
        self.norm = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 3)
        self.unused = nn.Linear(32, 32)


class _Foreign:  # any class: a safe load must refuse to rebuild it
    pass


def _bad_loads(path: str, full_path: str) -> dict[str, str]:
    """Save, then try broken loads: every one must fail with a clear error and leave the
    model and optimizer untouched."""
    s = metadist.strategy("zero3", min_unit_params=40, sync_batchnorm=True)
    net = make_net()
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    s.save(path, {"model": model, "optimizer": opt, "step": 1})
    s.save(full_path, {"model": model, "optimizer": opt, "step": 1}, format="full")
    before = snapshot(model, opt, s, [n for n, _ in make_net().named_parameters()])
    rank = metadist.world().rank
    errors: dict[str, str] = {}

    def attempt(case: str, target: str, state: dict[str, Any]) -> None:
        try:
            s.load(target, state)
        except CheckpointError as err:
            errors[case] = f"{type(err).__name__}: {err}"

    attempt("missing entry", path, {"model": model, "scheduler": _scheduler(opt)})
    attempt("wrong shape", path, {"model": metadist.strategy("ddp").setup_module(_Wider())})
    attempt("missing keys", path, {"model": metadist.strategy("ddp").setup_module(
        nn.Sequential(nn.Linear(10, 16)))})
    other = make_net()
    first_only = make_optimizer("adam", [next(iter(other.parameters()))])
    attempt("param count", path, {"optimizer": metadist.strategy("ddp").setup(
        other, first_only)[1]})
    attempt("kind", path, {"step": model})
    # an error on one rank only: every rank fails, nothing is copied in anywhere
    attempt("one rank", path, {"model": model, **({"extra": 1} if rank == 1 else {})})
    ckpt = Path(path)
    data = next(p for p in ckpt.iterdir() if p.name.startswith("v-"))
    weight = model.state_dict()["inp.weight"].numpy().tobytes()  # (collective under zero3)
    metadist.barrier()
    if rank == 0:  # damage copies, never the original
        for name, damage in (("flip", "flip"), ("trunc", "truncate"), ("objects", "objects"),
                             ("nomarker", "marker")):
            copy = ckpt.parent / name
            shutil.copytree(ckpt, copy)
            victim = copy / data.name / "rank-00001.bin"
            if damage == "flip":
                blob = bytearray(victim.read_bytes())
                blob[len(blob) // 2] ^= 0xFF
                victim.write_bytes(bytes(blob))
            elif damage == "truncate":
                victim.write_bytes(victim.read_bytes()[:-8])
            elif damage == "objects":
                (copy / data.name / "objects.pt").write_bytes(b"not a zip")
            else:
                (copy / "metadata.json").unlink()
        blob = bytearray(Path(full_path).read_bytes())
        blob[blob.find(weight) + 5] ^= 0xFF  # a bit flip inside a tensor's bytes
        Path(full_path + ".flip").write_bytes(bytes(blob))
        Path(full_path + ".trunc").write_bytes(Path(full_path).read_bytes()[:1000])
        torch.save({"model": {}}, full_path + ".foreign")
        torch.save({"metadist": {"format": "metadist.full"}, "x": _Foreign()},
                   full_path + ".pickle")
    metadist.barrier()
    both = {"model": model, "optimizer": opt}
    for name in ("flip", "trunc", "objects", "nomarker"):
        attempt(name, str(ckpt.parent / name), both)
    for suffix in (".flip", ".trunc", ".foreign", ".pickle"):
        attempt("full" + suffix, full_path + suffix, both)
    attempt("nothing", str(ckpt.parent / "nothing"), both)
    after = snapshot(model, opt, s, [n for n, _ in make_net().named_parameters()])
    for kind in ("params", "buffers", "state"):
        for k, v in before[kind].items():
            assert torch.equal(after[kind][k], v), f"{kind} {k} changed by a failed load"
    return errors


def test_broken_or_mismatched_checkpoints_fail_cleanly_and_change_nothing(
        tmp_path: Path) -> None:
    path, full_path = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    out = run_on_ranks(_bad_loads, 2, args=(path, full_path))
    assert out[0] == out[1]  # the same error on every rank
    errors = out[0]
    expected = {
        "missing entry": ("CheckpointMismatchError", "no entry 'scheduler'"),
        "wrong shape": ("CheckpointMismatchError", "state['model']['inp.weight'] has shape "
                        "[16, 10] in the checkpoint but [32, 10] here"),
        "missing keys": ("CheckpointMismatchError", "lacks '0.weight', '0.bias' and has "
                         "unexpected"),
        "param count": ("CheckpointMismatchError", "[8] parameters in the checkpoint but 1"),
        "kind": ("CheckpointMismatchError", "state['step'] is a module here"),
        "one rank": ("CheckpointMismatchError", "failed on rank 1"),
        "flip": ("CorruptCheckpointError", "rank-00001.bin: the bytes of state["),
        "trunc": ("CorruptCheckpointError", "truncated"),
        "objects": ("CorruptCheckpointError", "objects.pt fails its size/checksum check"),
        "nomarker": ("IncompleteCheckpointError", "marker metadata.json is missing"),
        "full.flip": ("CorruptCheckpointError", "full.pt.flip fails its sha256 check: the "
                      "bytes of state['model']['inp.weight'] fail their checksum"),
        "full.trunc": ("CorruptCheckpointError", "cannot be read as a checkpoint"),
        "full.foreign": ("CorruptCheckpointError", "is not a metadist checkpoint"),
        "full.pickle": ("CorruptCheckpointError", "Unsupported global"),
        "nothing": ("CheckpointError", "there is no checkpoint at"),
    }
    assert sorted(errors) == sorted(expected)
    for case, (cls, text) in expected.items():
        assert errors[case].startswith(cls + ":") and text in errors[case], (case, errors[case])
    assert issubclass(CheckpointMismatchError, metadist.MetadistError)
    assert "fail their checksum" in errors["flip"]
    # torch's advice to allowlist the global is never passed on for a foreign pickle.
    assert "which metadist never unpickles" in errors["full.pickle"]
    assert "add_safe_globals" not in errors["full.pickle"], errors["full.pickle"]
    assert issubclass(IncompleteCheckpointError, CheckpointError)


def _bad_saves(path: str) -> list[str]:
    s = metadist.strategy("ddp")
    net = make_net()
    model, _ = s.setup(net, make_optimizer("sgd", net.parameters()))
    out = []
    rank = metadist.world().rank
    for state in ({"model": model, "fn": lambda: 0},
                  {"model": model, **({"extra": 1} if rank == 1 else {})},
                  {"metadist": 1}):
        try:
            s.save(path, state)
        except CheckpointError as err:
            out.append(str(err))
    with pytest.raises(ValueError, match="choose one of: sharded, full"):
        s.save(path, {"model": model}, format="zip")
    return out


def test_unsavable_state_fails_every_rank_with_advice(tmp_path: Path) -> None:
    out = run_on_ranks(_bad_saves, 2, args=(str(tmp_path / "c"),))
    assert out[0] == out[1] and len(out[0]) == 3
    assert "state['fn'] is a builtins.function" in out[0][0] and "state_dict()" in out[0][0]
    assert "ranks passed different state" in out[0][1]
    assert "reserved" in out[0][2]
    assert not (tmp_path / "c" / "metadata.json").exists()


# ----- RNG ----------------------------------------------------------------------------------

def _rng(path: str, save: bool) -> list[float]:
    import numpy as np

    rank = metadist.world().rank
    s = metadist.strategy("ddp")
    if save:
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        s.save(path, {"step": 1})
    else:
        torch.manual_seed(0)
        s.load(path, {})
    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def test_rng_states_are_restored_per_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "rng")
    saved = run_on_ranks(_rng, 2, args=(path, True))
    assert saved[0] != saved[1]
    # same world size: each rank its own; a larger world: extra ranks take rank 0's
    assert run_on_ranks(_rng, 2, args=(path, False)) == saved
    assert run_on_ranks(_rng, 3, args=(path, False)) == [saved[0], saved[1], saved[0]]
