"""tests/test_gpu.py's rank bodies run on CPU ranks, with the same assertions.

The GPU tests skip on every machine without a GPU (CI never has one), so a mistake in a
body would first show the day a GPU is lent, in a 15-minute window. Here each body runs with
``kind="cpu"`` over gloo: its logic, its references and the properties test_gpu.py asserts
are checked on every run of the suite. What only a GPU can show (cuBLAS kernels, NCCL, the
CUDA allocator, host-device copies) is test_gpu.py's alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import gpu_bodies as bodies
from metadist.testing import run_on_ranks
from parity import assert_parity, assert_tensors_close, reference

SHARDED = {"min_unit_params": 40}


@pytest.mark.parametrize(("strategy", "options"), [("zero1", {}), ("hsdp", SHARDED)])
def test_parity_body(strategy: str, options: dict[str, Any]) -> None:
    got = run_on_ranks(bodies.parity, 1, args=("cpu", strategy, options))[0]
    assert_parity(got, reference("adam", world=1), f"{strategy} on cpu")


def test_overflow_body_skips_the_step_and_backs_off() -> None:
    got = run_on_ranks(bodies.overflow, 1, args=("cpu",))[0]
    assert got["devices"] == {"cpu"}
    assert got["skipped"] == [False, True, False]
    assert got["moved"] == [True, False, True]
    assert got["scales"][2] == got["scales"][1] / 2 and got["after"] == got["scales"][2]


def test_bf16_true_body() -> None:
    got = run_on_ranks(bodies.bf16_true, 1, args=("cpu", "zero3"))[0]
    assert got["params"] == {torch.bfloat16} and got["state"] == {torch.bfloat16}
    assert got["devices"] == {"cpu"} and got["ratio"] < 0.5


def test_checkpointing_body_trains_alike_and_keeps_less() -> None:
    got = run_on_ranks(bodies.checkpointing, 1,
                       args=("cpu", "zero3", {"wrap_classes": (bodies.Block,)}))[0]
    assert_tensors_close(got["checkpointed"]["state"], got["plain"]["state"], "zero3")
    assert got["checkpointed"]["held"] < got["plain"]["held"] / 2, got


def test_fast_maml_body_against_plain_torch() -> None:
    got = run_on_ranks(bodies.fast_maml, 1, args=("cpu", "zero3", SHARDED, "adam"))[0]
    assert_tensors_close(got["strategy"], got["plain"], "fast-weight MAML zero3")


@pytest.mark.parametrize(("strategy", "options"), [("ddp", {}), ("zero3", SHARDED)])
def test_maml_body_against_plain_torch(strategy: str, options: dict[str, Any]) -> None:
    """Bit-equal to plain torch at world 1 on the CPU, zero3 too: its full_parameters() hands
    every task of a meta-batch the same views, so each parameter's gradients add up in one
    process's order (fresh views per task summed per task first: 1.5e-8 off after 10
    meta-steps). test_gpu.py asks this of ddp on a GPU."""
    got = run_on_ranks(bodies.maml, 1, args=("cpu", strategy, options))[0]
    for name, want in got["plain"].items():
        assert torch.equal(got["strategy"][name], want), (
            f"MAML {strategy} {name}: {(got['strategy'][name] - want).abs().max():.3g} off")


def test_maml_body_on_two_ranks_against_one_process() -> None:
    want = run_on_ranks(bodies.maml, 1, args=("cpu", "zero3", SHARDED))[0]
    for rank, got in enumerate(run_on_ranks(bodies.maml, 2, args=("cpu", "zero3", SHARDED))):
        assert_tensors_close(got["strategy"], want["plain"], f"MAML zero3 rank {rank}")


def test_deferred_body_materialises_as_eager_construction() -> None:
    got = run_on_ranks(bodies.deferred, 1,
                       args=("cpu", "zero3", {"wrap_classes": (bodies.Block,)}))[0]
    assert got["deferred"]["devices"] == {"cpu"}
    for key, want in got["eager"]["first"].items():
        assert torch.equal(got["deferred"]["first"][key], want), key
    assert_tensors_close(got["deferred"]["final"], got["eager"]["final"], "zero3")


def test_checkpoint_bodies_round_trip(tmp_path: Path) -> None:
    first, then = str(tmp_path / "one"), str(tmp_path / "two")
    saved = run_on_ranks(bodies.save_trained, 1, args=("cpu", "zero3", SHARDED, first, 4))[0]
    for got in run_on_ranks(bodies.load_train_save, 2, args=("cpu", "ddp", {}, first, then, 3)):
        for kind in ("params", "state"):
            for name, want in saved[kind].items():
                assert torch.equal(got["loaded"][kind][name], want), f"{kind} {name}"
    back = run_on_ranks(bodies.load_train_save, 1,
                        args=("cpu", "zero3", SHARDED, then, None, 3))[0]
    assert_parity(back["final"], reference("adam", batchnorm=False), "one -> two -> one")
