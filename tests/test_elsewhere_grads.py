"""zero2: the gradients another rank owns are placeholders that say so.

Reproduction: under zero2 a rank keeps only the gradients of the parameters it owns, and the
others were None. A program that clipped with a norm written by hand
(``sqrt(sum(p.grad.norm() ** 2 for p in params if p.grad is not None))``) used this rank's
part of the norm and trained 1.05e-2 away from one process in 10 steps at 3 ranks, with
nothing to show it; a logged norm or largest gradient was this rank's part too. Now each of
those gradients is an ``ElsewhereGrad`` (strategies/tensors/elsewhere.py): changing one in place
does nothing (its owner makes the same change), a value computed from one is one, and a
value read out of one, or written from one into a tensor with values, stops with an error
naming the parameter, its owner and what to call.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.strategies import ElsewhereGrad, held_grad
from metadist.testing import run_on_ranks
from parity import assert_tensors_close
from test_shard_values import OPTIONS, Mlp, _batch, _step, _train
from test_torch_habits_grads import _attempt

N = 3  # three owners: every rank holds some gradients and not others
_WHY = "but zero2 keeps that gradient only on rank "


def _program(how: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
             y: torch.Tensor) -> None:
    """One step of a program as written for one process: what zero2 runs as it is."""
    params = list(model.parameters())
    if how == "torch's clip_grad_norm_":
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.05)
    elif how == "accumulate two halves":
        opt.zero_grad()
        half = x.shape[0] // 2
        for part in (slice(0, half), slice(half, None)):
            (nn.functional.mse_loss(model(x[part]), y[part]) / 2).backward()
    elif how == "no zero_grad":  # gradients accumulate across steps
        nn.functional.mse_loss(model(x), y).backward()
    elif how == "zero_grad(set_to_none=False)":
        opt.zero_grad(set_to_none=False)
        model.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x), y).backward()
    elif how == "printed":
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        shown = repr([p.grad for p in params])
        assert ("ElsewhereGrad" in shown) == isinstance(model, metadist.DistributedModule)
    else:
        _step(how, model, opt, x, y)
        return
    opt.step()


@pytest.mark.parametrize("how", ["decay by hand", "clip values by hand", "clamp weights",
                                 "torch's clip_grad_norm_", "accumulate two halves",
                                 "no zero_grad", "zero_grad(set_to_none=False)", "printed"])
def test_what_zero2_runs_equals_one_process(how: str) -> None:
    for rank, out in enumerate(run_on_ranks(_train, N, args=("zero2", how, _program))):
        assert "error" not in out, out.get("error")
        assert_tensors_close(out["got"], out["want"], where=f"zero2 rank {rank} {how}")
        assert out["elsewhere"] > 0, "every rank holds placeholders for others' gradients"


def test_a_norm_by_hand_equals_one_process() -> None:
    """A whole reduction of a gradient is its owner's value on every rank
    (strategies/tensors/whole_reductions.py), so clipping with a hand-written norm trains to
    one process's values. Before: it stopped with "float() reads the values of the
    gradient of ..." (and before the placeholders, trained 1.05e-2 away, silently)."""
    for rank, out in enumerate(run_on_ranks(_train, N, args=("zero2", "clip by hand"))):
        assert "error" not in out, out.get("error")
        assert_tensors_close(out["got"], out["want"], where=f"zero2 rank {rank}")


def _habits() -> dict[str, str]:
    torch.manual_seed(0)
    net = Mlp()
    model, _ = metadist.strategy("zero2", **OPTIONS["zero2"]).setup(
        net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())

    def sgd_by_hand() -> None:
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-0.1)

    return {
        "logged gradient norm": _attempt(lambda: torch.stack(
            [p.grad.norm() for p in params if p.grad is not None]).norm().item()),
        "largest gradient": _attempt(lambda: max(p.grad.abs().max() for p in params)),
        "formatted norm": _attempt(lambda: f"{sum(p.grad.norm() for p in params):.4f}"),
        "as numpy": _attempt(lambda: [p.grad.numpy() for p in params]),
        "a piece read": _attempt(lambda: [p.grad[0, 0].item() for p in params
                                          if p.grad.dim() == 2]),
        "SGD by hand": _attempt(sgd_by_hand),
        "get_total_norm": _attempt(lambda: torch.nn.utils.get_total_norm(
            [p.grad for p in params])),
        "what a tensor is": _attempt(lambda: [(p.grad.shape, p.grad.dtype, p.grad.device,
                                               p.grad.is_pinned()) for p in params]),
        "held gradients": _attempt(lambda: [held_grad(p).norm().item() for p in params
                                            if held_grad(p) is not None]),
        "strategy's clip": _attempt(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)),
    }


REFUSED = {"SGD by hand": r"ValueError: add_ would write the values .* into a tensor that "
                          r"holds values on this rank",
           "a piece read": r"ValueError: item\(\) reads the values"}


def test_what_reads_another_ranks_gradient_stops_and_says_what_to_call() -> None:
    """Each of these ran before with this rank's gradients alone (or failed on None); now
    those that need another rank's values stop, naming the parameter and its owner, and the
    rest run."""
    for rank, out in enumerate(run_on_ranks(_habits, N)):
        for habit, message in out.items():
            where = f"rank {rank} {habit}"
            pattern = REFUSED.get(habit)
            if pattern is None:
                assert message == "ok", f"{where}: {message}"
            else:
                assert re.match(pattern, message), f"{where}: {message}"
                assert _WHY in message and "'" in message, f"{where}: {message}"


def test_placeholder_arithmetic_in_one_process() -> None:
    """What each operation on a placeholder does, without ranks."""
    p = nn.Parameter(torch.ones(3, 4))
    q = nn.Parameter(torch.ones(2))
    p.grad = ElsewhereGrad.like(p, 1, "layer.weight")
    q.grad = torch.full((2,), 2.0)
    # in place: nothing here, the owner changes its own
    assert p.grad.mul_(3.0).clamp_(-1, 1) is p.grad
    # multi-tensor kernels position by position: the real tensor changes, the other does not
    torch._foreach_mul_([p.grad, q.grad], 0.5)
    assert torch.equal(q.grad, torch.ones(2))
    norms = torch._foreach_norm([p.grad, q.grad])
    assert isinstance(norms[0], ElsewhereGrad) and not isinstance(norms[1], ElsewhereGrad)
    assert torch.equal(norms[1], torch.tensor(2.0).sqrt())
    # computed from one: one, of the shape, dtype and device torch gives (a whole
    # reduction of a value of the gradient's shape is collective: test_shard_values.py)
    total = p.grad.t().double().norm() ** 2 + q.grad.norm() ** 2
    assert isinstance(total, ElsewhereGrad) and total.shape == () \
        and total.dtype == torch.float64 and total.param_name == "layer.weight"
    assert isinstance(p.grad.t() @ torch.ones(3, 2), ElsewhereGrad)
    # reading or writing values out of one stops
    with pytest.raises(ValueError, match=r"item\(\) reads the values of the gradient of "
                                         r"'layer.weight'.*only on rank 1"):
        total.item()
    with pytest.raises(ValueError, match="copy_ would write"):
        torch.zeros(3, 4).copy_(p.grad)
    with pytest.raises(ValueError, match="_foreach_add_ would write"):
        torch._foreach_add_([q.grad], [total])
    # a copy of the model leaves it behind, as torch leaves every gradient
    assert copy.deepcopy(p).grad is None
    assert held_grad(p) is None and held_grad(q) is q.grad


def _counts() -> dict[str, Any]:
    """A backward never accumulates into a placeholder: a second backward without
    zero_grad gives a non-owner's gradient as the new one alone (the owner's sums both)."""
    torch.manual_seed(0)
    net = Mlp()
    strategy = metadist.strategy("zero2", **OPTIONS["zero2"])
    model, _ = strategy.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch(metadist.world().rank)
    with strategy.no_sync(model):
        nn.functional.mse_loss(model(x), y).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    nn.functional.mse_loss(model(x), y).backward()  # synced: placeholders appear
    placeholders = [n for n, p in model.named_parameters() if isinstance(p.grad, ElsewhereGrad)]
    with strategy.no_sync(model):
        nn.functional.mse_loss(model(x), y).backward()
    return {"placeholders": placeholders,
            "fresh": all(torch.equal(dict(model.named_parameters())[n].grad, local[n])
                         for n in placeholders)}


def test_a_backward_replaces_a_placeholder_rather_than_adding_to_it() -> None:
    outs = run_on_ranks(_counts, 2)
    assert all(out["placeholders"] for out in outs)
    assert sorted(n for out in outs for n in out["placeholders"]) == \
        sorted(f"module.{n}" for n, _ in Mlp().named_parameters())  # one owner each
    assert all(out["fresh"] for out in outs)


def _memory_measure() -> tuple[int, int, list[bool]]:
    torch.manual_seed(0)
    net = Mlp()
    strategy = metadist.strategy("zero2", **OPTIONS["zero2"])
    model, _ = strategy.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch(metadist.world().rank)
    nn.functional.mse_loss(model(x), y).backward()
    total = 0
    for p in model.parameters():  # a memory measure as written for one process
        if p.grad is not None:
            total += p.grad.untyped_storage().nbytes()
    held = sum(g.untyped_storage().nbytes() for p in model.parameters()
               if (g := held_grad(p)) is not None)
    return total, held, [p.grad is not None and not p.grad.is_pinned()
                         for p in model.parameters()]


def test_a_memory_measure_reads_what_this_rank_holds() -> None:
    """Before: ``p.grad.untyped_storage().nbytes()`` raised "untyped_storage() reads the
    values of the gradient ..." on a placeholder. A placeholder's part on this rank has no
    storage: the measure counts the gradients this rank holds."""
    outs = run_on_ranks(_memory_measure, 2)
    for total, held, present in outs:
        assert total == held > 0 and all(present)
    # every gradient is held by one rank (in its bucket's storage, which may hold more)
    assert sum(held for _, held, _ in outs) >= 4 * sum(p.numel() for p in Mlp().parameters())


def _reads() -> dict[str, Any]:
    torch.manual_seed(0)
    net = Mlp()
    plain = copy.deepcopy(net)
    model, _ = metadist.strategy("zero2", **OPTIONS["zero2"]).setup(
        net, torch.optim.SGD(net.parameters(), lr=0.1))
    w = metadist.world()
    x, y = _batch(0)
    per = x.shape[0] // w.world_size
    nn.functional.mse_loss(model(x[w.rank * per:(w.rank + 1) * per]),
                           y[w.rank * per:(w.rank + 1) * per]).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    params, ref = list(model.parameters()), list(plain.parameters())
    return {"lists": [p.grad.tolist() for p in params],
            "want lists": [p.grad.tolist() for p in ref],
            "arrays": [p.grad.double().numpy().sum() for p in params],
            "formatted": [f"{p.grad.abs().max():.6f}" for p in params],
            "want formatted": [f"{p.grad.abs().max():.6f}" for p in ref],
            "total": float(torch.nn.utils.get_total_norm([p.grad for p in params])),
            "want total": float(torch.nn.utils.get_total_norm([p.grad for p in ref]))}


def test_reads_of_a_whole_gradient_give_its_owners_values_on_every_rank() -> None:
    """``p.grad.tolist()``, ``.numpy()``, a formatted number and ``get_total_norm`` over
    every gradient give one process's values on every rank (a broadcast from the owner, an
    all-reduce joined by the placeholders). Before: "tolist() reads the values of the
    gradient of ...", and "get_total_norm over zero2 gradients" raised. The gradients are
    of the same global batch summed in another order: float32 roundoffs (rtol 1e-5)."""
    outs = run_on_ranks(_reads, N)
    for out in outs:
        for got, want in zip(out["lists"], out["want lists"], strict=True):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
        # six decimals: equal but for a last digit a float32 roundoff may flip
        assert [float(v) for v in out["formatted"]] == pytest.approx(
            [float(v) for v in out["want formatted"]], abs=1.5e-6)
        assert out["total"] == pytest.approx(out["want total"], rel=1e-5)
        assert out["arrays"] == outs[0]["arrays"]  # every rank reads the owner's values
