"""Corruption never loads silently: every byte a load trusts is checksummed.

Seeded fuzzing (bit flips, truncations, byte edits over every file of a small sharded and a
small full checkpoint): each case either loads exactly the saved state or raises
:class:`CheckpointError` and leaves memory unchanged. Plus the reproductions of the two
silent loads that motivated whole-file digests, and the messages for a damaged index.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from metadist.checkpoint import CheckpointError, CorruptCheckpointError
from metadist.checkpoint import rng as rng_state
from metadist.checkpoint.digest import seal_json
from metadist.checkpoint.index import MARKER
from metadist.testing import run_on_ranks

STEP = 123456


class _Counter:
    """A stateful object (stands in for a scaler): saved through state_dict()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "scale": float(self.n) / 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def _state(seed: int) -> tuple[metadist.Strategy, dict[str, Any]]:
    """A small training state with one of each kind of entry; ``seed`` makes it distinct."""
    torch.manual_seed(seed)
    strategy = metadist.strategy("single")
    net = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    model, opt = strategy.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    sched.step()
    loader = strategy.setup_dataloader(DataLoader(TensorDataset(torch.arange(12)),
                                                  batch_size=2, shuffle=True))
    it = iter(loader)
    for _ in range(seed % 3 + 1):
        next(it)
    return strategy, {"model": model, "optimizer": opt, "scheduler": sched,
                      "scaler": _Counter(seed), "loader": loader, "step": STEP + seed,
                      "best": torch.tensor([0.25 + seed]), "note": f"run {seed}"}


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a load may change, as plain data."""
    out = {k: (v.state_dict() if hasattr(v, "state_dict") else v)
           for k, v in state.items()}
    out["model"] = {k: v.clone() for k, v in out["model"].items()}
    out["rng"] = rng_state.capture()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def _save(root: Path) -> tuple[Path, Path, dict[str, Any]]:
    strategy, state = _state(1)
    torch.manual_seed(1234)  # the RNG state the checkpoints record
    saved = _snapshot(state)
    sharded, full = root / "sharded", root / "full.pt"
    strategy.save(sharded, state)
    strategy.save(full, state, format="full")
    return sharded, full, saved


def _load(path: Path, saved: dict[str, Any]) -> str:
    """"loaded" (the saved state, exactly), "refused" (CheckpointError, memory unchanged) or
    "silent" (anything else: a different state, or another exception)."""
    strategy, state = _state(2)
    before = _snapshot(state)
    try:
        strategy.load(path, state)
    except CheckpointError:
        return "refused" if _same(_snapshot(state), before) else "silent"
    except Exception as err:
        return f"silent: {type(err).__name__}: {err}"
    return "loaded" if _same(_snapshot(state), saved) else "silent"


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _mutate(blob: bytes, rnd: random.Random) -> tuple[str, bytes]:
    out = bytearray(blob)
    match rnd.choice(["flip", "flip", "truncate", "edit"]):
        case "flip":
            i = rnd.randrange(len(out) * 8)
            out[i // 8] ^= 1 << (i % 8)
            return f"flip bit {i}", bytes(out)
        case "truncate":
            n = rnd.randrange(len(out))
            return f"truncate to {n}", bytes(out[:n])
        case _:
            i = rnd.randrange(len(out))
            out[i] = (out[i] + rnd.randrange(1, 256)) % 256
            return f"edit byte {i}", bytes(out)


def _campaign(source: Path, work: Path, cases: int, seed: int, saved: dict[str, Any]
              ) -> dict[str, list[str]]:
    rnd = random.Random(seed)
    files = _files(source)
    outcomes: dict[str, list[str]] = {}
    for case in range(cases):
        copy = work / f"case-{case}{source.suffix}"
        if source.is_dir():
            shutil.copytree(source, copy)
        else:
            shutil.copyfile(source, copy)
        victim = rnd.choice(files)
        target = copy / victim.relative_to(source) if source.is_dir() else copy
        what, blob = _mutate(target.read_bytes(), rnd)
        target.write_bytes(blob)
        outcome = _load(copy, saved)
        outcomes.setdefault(outcome.split(":")[0], []).append(
            f"{victim.name} {what}: {outcome}")
        shutil.rmtree(copy) if copy.is_dir() else copy.unlink()
    return outcomes


@pytest.mark.parametrize(("fmt", "cases"), [("sharded", 200), ("full", 120)])
def test_fuzzed_checkpoints_load_exactly_or_fail(tmp_path: Path, fmt: str, cases: int) -> None:
    sharded, full, saved = _save(tmp_path)
    assert _load(sharded, saved) == "loaded" and _load(full, saved) == "loaded"
    outcomes = _campaign(sharded if fmt == "sharded" else full, tmp_path, cases, 7, saved)
    assert not outcomes.get("silent"), outcomes["silent"][:10]
    # Every byte is covered by a digest or checksum: no change at all goes unnoticed.
    assert len(outcomes.get("refused", [])) == cases, outcomes.get("loaded")


def _edit_and_load(path: Path, saved: dict[str, Any], old: bytes, new: bytes) -> str:
    blob = path.read_bytes()
    assert blob.count(old) >= 1, old
    path.write_bytes(blob.replace(old, new, 1))
    return _load(path.parent if path.name == MARKER else path, saved)


def test_a_changed_plain_value_in_a_full_checkpoint_is_refused(tmp_path: Path) -> None:
    _, full, saved = _save(tmp_path)
    # `step` (123457: pickled as a 4-byte int) becomes 123458 when one byte changes
    old = (STEP + 1).to_bytes(4, "little")
    assert _edit_and_load(full, saved, old, (STEP + 2).to_bytes(4, "little")) == "refused"


def test_a_renamed_entry_in_sharded_metadata_is_refused(tmp_path: Path) -> None:
    sharded, _, saved = _save(tmp_path)
    marker = sharded / MARKER
    assert _edit_and_load(marker, saved, b'"optimizer",\n    "0"',
                          b'"optimize2",\n    "0"') == "refused"


def test_an_unsealed_index_from_before_digests_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before digests (format version 1) load with the older checks."""
    sharded, _, saved = _save(tmp_path)
    marker = sharded / MARKER
    doc = json.loads(marker.read_text())
    doc.pop("sha256")
    doc["version"] = 1
    marker.write_text(json.dumps(doc, indent=1))
    assert _load(sharded, saved) == "loaded"
    doc["version"] = 2  # a version-2 index must carry its digest
    marker.write_text(json.dumps(doc, indent=1))
    assert _load(sharded, saved) == "refused"


def test_an_unsealed_full_file_from_before_digests_still_loads(tmp_path: Path) -> None:
    _, full, saved = _save(tmp_path)
    doc = torch.load(full, weights_only=True)
    doc["metadist"]["version"] = 1
    torch.save(doc, full)  # as metadist wrote it before digests: no archive comment
    assert _load(full, saved) == "loaded"
    doc["metadist"]["version"] = 2  # a version-2 file must carry its digest
    torch.save(doc, full)
    assert _load(full, saved) == "refused"


# ----- the index's own checks (a resealed index: what a digest cannot tell) ---------------

def _reseal(sharded: Path, change: Any) -> str:
    marker = sharded / MARKER
    doc = json.loads(marker.read_text())
    doc.pop("sha256")
    change(doc)
    marker.write_bytes(seal_json(doc))
    strategy, state = _state(2)
    with pytest.raises(CorruptCheckpointError) as info:
        strategy.load(sharded, state)
    return str(info.value)


def _tensor(doc: dict[str, Any], key: list[str]) -> dict[str, Any]:
    return next(t for t in doc["tensors"] if t["key"] == key)


def test_index_damage_is_reported_with_file_and_key(tmp_path: Path) -> None:
    sharded, _, _ = _save(tmp_path)
    weight = ["model", "0.weight"]

    def negative(doc: dict[str, Any]) -> None:
        _tensor(doc, weight)["pieces"][0]["offset"] = -4

    def dtype(doc: dict[str, Any]) -> None:
        _tensor(doc, weight)["dtype"] = "float16"

    def missing(doc: dict[str, Any]) -> None:
        doc["tensors"].remove(_tensor(doc, weight))

    def count(doc: dict[str, Any]) -> None:
        _tensor(doc, weight)["pieces"][0]["stop"] -= 1

    def renamed(doc: dict[str, Any]) -> None:
        _tensor(doc, ["optimizer", "0", "exp_avg"])["key"][0] = "optimize2"

    key = "state['model']['0.weight']"
    expected = {
        negative: [key, "rank-00000.bin", "negative"],
        dtype: [key, "rank-00000.bin", "float16"],
        missing: [key, "missing from the checkpoint"],
        count: [key, "rank-00000.bin", "cover"],
        renamed: ["'optimize2'", "no such entry"],
    }
    for change, parts in expected.items():
        copy = tmp_path / change.__name__
        shutil.copytree(sharded, copy)
        message = _reseal(copy, change)
        assert str(copy / MARKER) in message or str(copy) in message, message
        for part in parts:
            assert part in message, (change.__name__, message)
    # A pickle that is not a zip archive (torch's legacy format) is not a metadist checkpoint.
    legacy = tmp_path / "legacy.pt"
    torch.save({"model": {}}, legacy, _use_new_zipfile_serialization=False)
    strategy, state = _state(2)
    with pytest.raises(CorruptCheckpointError, match="not a zip archive") as info:
        strategy.load(legacy, state)
    assert "mmap" not in str(info.value) and str(legacy) in str(info.value)


# ----- two ranks ----------------------------------------------------------------------------

def _two_rank_corrupt_full(path: str) -> str:
    s = metadist.strategy("zero3", min_unit_params=10)
    net = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    model, opt = s.setup(net, torch.optim.Adam(net.parameters()))
    s.save(path, {"model": model, "optimizer": opt, "step": STEP}, format="full")
    metadist.barrier()
    if metadist.world().rank == 0:
        blob = bytearray(Path(path).read_bytes())
        blob[blob.find(STEP.to_bytes(4, "little"))] ^= 1  # step 123456 -> 123457
        Path(path).write_bytes(bytes(blob))
    metadist.barrier()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    try:
        s.load(path, state)
    except CheckpointError as err:
        assert state["step"] == 0
        return str(err)
    return f"loaded step {state['step']}"


def test_a_corrupted_full_checkpoint_fails_on_every_rank(tmp_path: Path) -> None:
    out = run_on_ranks(_two_rank_corrupt_full, 2, args=(str(tmp_path / "f.pt"),))
    assert out[0] == out[1] and "sha256" in out[0] and "f.pt" in out[0], out
