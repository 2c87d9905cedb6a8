"""Cooperative fast weights (model.fast_weights()): one inner problem per group of ranks,
kept as shards under zero3/hsdp. Second-order MAML equals one process on the whole batch
under every strategy (tests/fast_meta.py), and under zero3/hsdp each rank's memory for the
meta-step falls as 1/N."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fast_meta
import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

SHARDED = {"min_unit_params": 50}  # several units, padded flats at 3 ranks
# (strategy, world size, simulated nodes, options)
CASES = [("single", 1, 1, {}), ("ddp", 2, 1, {}), ("zero1", 3, 1, {}), ("zero2", 4, 1, {}),
         ("zero3", 2, 1, SHARDED), ("zero3", 3, 1, SHARDED), ("zero3", 4, 1, SHARDED),
         ("hsdp", 4, 2, SHARDED)]


@pytest.fixture(scope="module")
def want() -> dict[str, dict[str, torch.Tensor]]:
    return {update: fast_meta.reference("adam", update) for update in ("sgd", "adam",
                                                                       "clipped")}


def _check(out: list[dict[str, torch.Tensor]], want: dict[str, torch.Tensor],
           where: str) -> None:
    for rank, got in enumerate(out):
        assert_tensors_close(got, want, f"{where} rank={rank}")


@pytest.mark.parametrize(("strategy", "n", "nnodes", "options"), CASES)
def test_cooperative_maml_matches_one_process(strategy: str, n: int, nnodes: int,
                                              options: dict[str, Any],
                                              want: dict[str, dict[str, torch.Tensor]]) -> None:
    """Second-order MAML, 3 inner SGD steps per task, 4 tasks, Adam outer, 10 meta-steps."""
    out = run_on_ranks(fast_meta.on_rank, n, nnodes=nnodes, timeout=300,
                       args=(strategy, options, "adam", "sgd"))
    _check(out, want["sgd"], f"{strategy} n={n}")


@pytest.mark.parametrize("update", ["adam", "clipped"])
@pytest.mark.parametrize(("strategy", "n", "nnodes"), [("zero3", 3, 1), ("hsdp", 4, 2)])
def test_inner_updates_on_shards(strategy: str, n: int, nnodes: int, update: str,
                                 want: dict[str, dict[str, torch.Tensor]]) -> None:
    """An Adam-style inner update (map over the pieces) and one clipped by the global norm
    (fast.norm(): one collective) on shards equal one process's."""
    out = run_on_ranks(fast_meta.on_rank, n, nnodes=nnodes, timeout=300,
                       args=(strategy, SHARDED, "adam", update))
    _check(out, want[update], f"{strategy} n={n} {update}")


def test_activation_checkpointing_recomputes_on_the_fast_weights(
        want: dict[str, dict[str, torch.Tensor]]) -> None:
    """The recomputation in backward gathers the same fast weights, not the model's shards
    (which would be a silently different gradient)."""
    options = {**SHARDED, "activation_checkpointing": nn.Linear}
    out = run_on_ranks(fast_meta.on_rank, 2, timeout=300,
                       args=("zero3", options, "adam", "sgd"))
    _check(out, want["sgd"], "zero3 checkpointed")


def test_torchopt_functional_optimisers_on_fast_weights() -> None:
    """TorchOpt's functional API (the drop-in) takes fast weights as a pytree: clipping by
    the global norm (over every shard) and Adam on shards equal one process."""
    want = run_on_ranks(fast_meta.torchopt_on_rank, 1, args=("single",))[0]
    for strategy, n, nnodes in (("zero3", 3, 1), ("hsdp", 4, 2)):
        out = run_on_ranks(fast_meta.torchopt_on_rank, n, nnodes=nnodes, timeout=300,
                           args=(strategy, SHARDED))
        _check(out, want, f"{strategy} n={n} torchopt")


# ----- memory ----------------------------------------------------------------------------------
def test_sharded_meta_step_memory_falls_as_one_over_n() -> None:
    """Per-rank peak of one meta-step (3 inner steps, create_graph) in bytes of live storages:
    at N ranks sharded it stays within 1.2 x (one process's) / N + two units' full size, at
    N = 2 and 4 (zero3) and hsdp 2 x 2 (shard factor 2). The gathered path does not (the
    measure tells the two apart)."""
    one = run_on_ranks(fast_meta.meta_step_peak, 1, args=("ddp", "gathered"))[0]
    unit = fast_meta.unit_bytes()
    wide = {"wrap_classes": (nn.Linear,)}
    peaks = {}
    for strategy, n, nnodes, factor in (("zero3", 2, 1, 2), ("zero3", 4, 1, 4),
                                        ("hsdp", 4, 2, 2)):
        out = run_on_ranks(fast_meta.meta_step_peak, n, nnodes=nnodes, timeout=300,
                           args=(strategy, "sharded", wide))
        bound = 1.2 * one / factor + 2 * unit
        peaks[(strategy, n)] = max(out)
        assert max(out) <= bound, (f"{strategy} N={n}: peak {max(out)} B per rank over "
                                   f"the bound {bound:.0f} B (one process: {one} B)")
    assert peaks[("zero3", 4)] < peaks[("zero3", 2)]
    gathered = max(run_on_ranks(fast_meta.meta_step_peak, 4, timeout=300,
                                args=("zero3", "gathered", wide)))
    assert gathered > 1.2 * one / 4 + 2 * unit, (gathered, one)


def test_meta_steps_keep_nothing_from_one_step_to_the_next() -> None:
    """Training meta-steps on fast weights leave no storage alive from one to the next, in
    bytes of live storages (before: a gather's record and its backward node held each
    other, a cycle through C++ that no collection frees, and the registry of gathers held
    the records: every step's fast-weight pieces and the graph behind them stayed alive)."""
    wide = {"wrap_classes": (nn.Linear,)}
    for strategy, n, nnodes, path in (("zero3", 2, 1, "sharded"), ("hsdp", 4, 2, "sharded"),
                                      ("zero3", 3, 1, "gathered")):
        kept = run_on_ranks(fast_meta.meta_steps_kept, n, nnodes=nnodes, timeout=300,
                            args=(strategy, path, wide))
        assert max(kept) == 0, f"{strategy} N={n} {path}: {kept} B kept per rank"


def _kept_by_a_saved_output() -> bool:
    from torch.multiprocessing.reductions import StorageWeakRef

    from metadist.strategies.zero3.shard_gather import saved_as_shards

    x = torch.randn(16, requires_grad=True)
    with saved_as_shards():
        y = x.tanh()  # saves its own output
    ref = StorageWeakRef(y.untyped_storage())
    del y
    return not ref.expired()


def test_an_output_saved_inside_the_hooks_dies_with_its_graph() -> None:
    """The saved-tensors hook hands autograd what it does not keep as shards detached: a
    node saving its own output otherwise holds itself through the hook's result, a cycle
    no collection frees (before: the output of tanh, and the graph behind it, stayed)."""
    assert not _kept_by_a_saved_output()


class _FrozenHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(64, 64), nn.Linear(64, 64)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (self(x) @ self.head.weight).pow(2).sum()  # head read outside its forward


def _kept_by_a_read_outside_the_forward() -> int:
    from metadist.testing import bytes_kept_by

    torch.manual_seed(0)
    s = metadist.strategy("zero3", wrap_classes=(nn.Linear,))
    net = _FrozenHead()
    model, _ = s.setup(net, torch.optim.SGD(net.body.parameters(), lr=0.1))
    x, fast, out = torch.randn(4, 64), model.fast_weights(), []

    def loss() -> None:
        with model.bound(fast):
            out.append(model.loss(x))

    return bytes_kept_by(loss)[1]


def test_a_frozen_weight_read_outside_its_forward_is_saved_as_a_shard() -> None:
    """A frozen unit gathered for a read outside its forward (a loss through a module's
    method) and saved by autograd is kept as a reference to its shard: the graph holds the
    activations (4 x 64 floats), not the unit's whole buffer (64 x 65 floats)."""
    whole = 64 * 65 * 4
    for kept in run_on_ranks(_kept_by_a_read_outside_the_forward, 2):
        assert kept < whole, f"{kept} B kept: the frozen unit's whole buffer is {whole} B"


# ----- what it refuses -------------------------------------------------------------------------
def _uneven_weights() -> str:
    s = metadist.strategy("zero3", min_unit_params=50)
    model = fast_meta.net()
    model, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    w = metadist.world()
    s.set_batch_weight(3 if w.rank == 0 else 1, 4)  # a ragged batch: 3 samples and 1
    fast = model.fast_weights()
    x = torch.randn(3 if w.rank == 0 else 1, 3)
    try:
        fast.grad(model.functional_forward(fast, x).pow(2).mean())
    except ValueError as e:
        return str(e)
    return "no error"


def test_uneven_batch_weights_are_refused() -> None:
    """Every rank's outer loss reaches the shards mixed with the others' (through the
    group's inner gradients) before its own weight could be applied: unequal weights
    would be silently wrong, so they stop with what to write instead."""
    for message in run_on_ranks(_uneven_weights, 2):
        assert "weight its loss alike" in message and "drop_last=True" in message, message


def _misuse() -> list[str]:
    s = metadist.strategy("zero3", min_unit_params=50)
    a, b = fast_meta.net(), fast_meta.net()
    ma, _ = s.setup(a, torch.optim.SGD(a.parameters(), lr=0.1))
    mb, _ = s.setup(b, torch.optim.SGD(b.parameters(), lr=0.1))
    fa, fb = ma.fast_weights(), mb.fast_weights()
    errors = []
    for attempt in (lambda: mb.functional_forward(fa, torch.randn(2, 3)),
                    lambda: fa + fb,
                    lambda: fa * torch.ones(3),
                    lambda: fa.like({"0.weight": torch.ones(33, 3)}),
                    lambda: fa.map(lambda p: p / p.norm())):
        try:
            attempt()
            errors.append("no error")
        except (ValueError, TypeError, KeyError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_fast_weights_of_another_model_or_shape_are_refused() -> None:
    errors = run_on_ranks(_misuse, 2)[0]
    assert "another model" in errors[0], errors
    assert "different models" in errors[1], errors
    assert "fast.like" in errors[2], errors
    assert "KeyError" in errors[3] and "2.weight" in errors[3], errors
    assert "not element-wise" in errors[4] and "fast.norm()" in errors[4], errors


def _per_piece_norm(strategy: str) -> str:
    s = metadist.strategy(strategy, **(SHARDED if strategy == "zero3" else {}))
    model = fast_meta.net()
    model, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        model.fast_weights().map(lambda p: p / p.norm())
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(("strategy", "n"), [("single", 1), ("ddp", 2), ("zero3", 2)])
def test_a_per_piece_reduction_raises_under_every_strategy(strategy: str, n: int) -> None:
    """A piece is a whole parameter under ddp and a flat slice of several under zero3, so a
    per-piece norm would silently differ between them: it raises everywhere, the same
    (inside fast.map under every strategy; on a shard piece anywhere)."""
    for message in run_on_ranks(_per_piece_norm, n, args=(strategy,)):
        assert "norm" in message and "not element-wise" in message, message
        assert "fast.norm()" in message, message


def _reductions_on_pieces() -> list[str]:
    """What a library sees when it takes fast weights as a pytree: the pieces."""
    from torch.utils._pytree import tree_flatten

    s = metadist.strategy("zero3", **SHARDED)
    model = fast_meta.net()
    model, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fast = model.fast_weights()
    grads = fast.grad(fast_meta._mse(model.functional_forward(fast, torch.randn(4, 3)),
                                     torch.randn(4, 2)))
    leaves, _ = tree_flatten(grads)
    derived = [g * 2 + 1 for g in leaves]  # element-wise: still pieces
    out = []
    for attempt in (lambda: torch.stack([g.norm() for g in leaves]),
                    derived[0].sum, lambda: leaves[0][:3],
                    lambda: torch.cat(leaves), lambda: leaves[0].reshape(-1, 1),
                    # composites no list of names held: decided by the operators they run
                    lambda: torch.linalg.vector_norm(leaves[0]),
                    lambda: torch.nn.functional.normalize(leaves[0], dim=0)):
        try:
            attempt()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    out.append(repr(float(grads.norm())))  # what to write instead works
    return out


def test_a_reduction_on_shard_pieces_taken_as_a_pytree_raises() -> None:
    """An optimiser's transformation clipping by the norm of its leaves, a sum, an index or
    a concatenation of pieces would compute something else under zero3 than under ddp: on
    shard pieces, and on what is computed from them element-wise, they raise."""
    for out in run_on_ranks(_reductions_on_pieces, 2):
        for message in out[:7]:
            assert "not element-wise" in message and "fast.norm()" in message, out
        assert "runs linalg_vector_norm" in out[5] and "runs linalg_vector_norm" in out[6]
        assert float(out[7]) > 0
