"""Torch's gradient utilities on a set-up model's parameters: the global result or an error.

Reproduction of issue 18: ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` under
zero3 clipped with this rank's part of the norm (and under zero2 too: gradients live on
their owners), silently. Now ``clip_grad_norm_``, ``get_total_norm`` and ``clip_grad_value_``
match one process on the same global batch over 10 steps, also on a subset of the
parameters, and what cannot be right (``parameters_to_vector`` over shards, a norm of zero2
gradients, ``model.module.parameters()`` under zero3) raises saying what to call instead.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import metadist
from metadist.strategies.tensors import grad_norm
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

D = 8
STEPS = 10
GLOBAL_BATCH = 24
OPTIONS: dict[str, dict[str, Any]] = {
    "ddp": {}, "zero1": {}, "zero2": {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.0001},
    "zero3": {"min_unit_params": 10}, "hsdp": {"min_unit_params": 10},
}
# (strategy, ranks, nodes): 3 ranks give uneven flats; hsdp 4 = 2 nodes x 2 (shards within a
# node, replicas across), hsdp 2 = 2 nodes x 1 (replicas only).
CELLS = [("ddp", 3, 1), ("zero2", 3, 1), ("zero3", 3, 1), ("hsdp", 2, 2), ("hsdp", 4, 2)]


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.hidden = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(torch.tanh(self.hidden(torch.tanh(self.embed(x))))))


def _close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert_tensors_close({"": got}, {"": want}, where=where)


def _setup(strategy: str) -> tuple[metadist.Strategy, nn.Module, torch.optim.Optimizer,
                                   nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Mlp()
    plain = copy.deepcopy(net)
    s = metadist.strategy(strategy, **OPTIONS[strategy])
    model, opt = s.setup(net, torch.optim.SGD(
        [p for p in net.parameters() if p.requires_grad], lr=0.5))
    popt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.5)
    return s, model, opt, plain, popt


def _backward(model: nn.Module, plain: nn.Module, step: int) -> None:
    """This rank's slice of the global batch through ``model``, the whole through ``plain``."""
    w = metadist.world()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    per = GLOBAL_BATCH // w.world_size
    lo = w.rank * per
    nn.functional.mse_loss(model(x[lo:lo + per]), y[lo:lo + per]).backward()
    nn.functional.mse_loss(plain(x), y).backward()


def _train(strategy: str, how: str) -> dict[str, Any]:
    s, model, opt, plain, popt = _setup(strategy)
    results = []
    for step in range(STEPS):
        opt.zero_grad()
        popt.zero_grad()
        _backward(model, plain, step)
        if how == "norm":  # max_norm small enough to clip at every step
            results.append((torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05),
                            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)))
        elif how.startswith("strategy"):  # strategy.clip_grad_norm_(model, c), p=2 or inf
            p = float("inf") if how == "strategy inf" else 2.0
            results.append((s.clip_grad_norm_(model, 0.05 if p == 2 else 0.01, norm_type=p),
                            torch.nn.utils.clip_grad_norm_(plain.parameters(),
                                                           0.05 if p == 2 else 0.01,
                                                           norm_type=p)))
        elif how == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            torch.nn.utils.clip_grad_value_(plain.parameters(), 0.01)
        else:  # get_total_norm, then clip_grads_with_norm_ (torch's two-step form)
            got = torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None])
            want = torch.nn.utils.get_total_norm(
                [p.grad for p in plain.parameters() if p.grad is not None])
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05, got)
            torch.nn.utils.clip_grads_with_norm_(plain.parameters(), 0.05, want)
            results.append((got, want))
        opt.step()
        popt.step()
    return {"norms": results, "got": model.state_dict(), "want": plain.state_dict()}


@pytest.mark.parametrize(("strategy", "n", "nodes", "how"), [
    *((*cell, "strategy") for cell in [*CELLS, ("zero1", 3, 1)]),
    ("zero2", 3, 1, "strategy inf"), ("zero3", 3, 1, "strategy inf"),
    ("hsdp", 4, 2, "strategy inf")])
def test_strategy_clip_grad_norm_clips_with_the_global_norm(strategy: str, n: int,
                                                            nodes: int, how: str) -> None:
    """strategy.clip_grad_norm_(model, c) returns the global norm and clips with it (small
    enough to clip at every step): the norms and the trained parameters match one process."""
    for rank, out in enumerate(run_on_ranks(_train, n, args=(strategy, how), nnodes=nodes)):
        where = f"{strategy} n={n} rank {rank} {how}"
        for step, (got, want) in enumerate(out["norms"]):
            _close(got, want, f"{where} step {step} norm")
        assert_tensors_close(out["got"], out["want"], where=where)


def _float64_clip(strategy: str) -> tuple[float, float]:
    """strategy.clip_grad_norm_ of float64 gradients against torch's: the norm's relative
    difference, and whether it is returned in float64."""
    torch.manual_seed(0)
    net = Mlp().double()
    plain = copy.deepcopy(net)
    s = metadist.strategy(strategy, **OPTIONS[strategy])
    model, _ = s.setup(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad],
                                            lr=0.5))
    w = metadist.world()
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64),
            torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64))
    per = GLOBAL_BATCH // w.world_size
    nn.functional.mse_loss(model(x[w.rank * per:(w.rank + 1) * per]),
                           y[w.rank * per:(w.rank + 1) * per]).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    got = s.clip_grad_norm_(model, 0.05)
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    return abs(got.item() - want.item()) / want.item(), got.dtype == torch.float64


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_sharded_clipping_of_float64_gradients_is_float64(strategy: str) -> None:
    """strategy.clip_grad_norm_ computes a float64 model's norm in float64, as torch does
    (measured 1.1e-16 under ddp and zero1; 1e-13 leaves room for the order of the ranks'
    sums). zero2 and zero3 summed it in float32 (off by 1.2e-8 and 4.8e-8, a float32 norm)
    until their sum was in float64."""
    for norm, is_float64 in run_on_ranks(_float64_clip, 3, args=(strategy,)):
        assert norm < 1e-13 and is_float64, (norm, is_float64)


# get_total_norm over zero2 gradients: the owners' and the placeholders (it raised before)
@pytest.mark.parametrize(("strategy", "n", "nodes", "how"), [
    (*cell, how) for cell in CELLS for how in ("norm", "value", "total")])
def test_torch_clipping_matches_one_process(strategy: str, n: int, nodes: int,
                                            how: str) -> None:
    for rank, out in enumerate(run_on_ranks(_train, n, args=(strategy, how), nnodes=nodes)):
        where = f"{strategy} n={n} rank {rank} {how}"
        for step, (got, want) in enumerate(out["norms"]):
            _close(got, want, f"{where} step {step} norm")
        assert_tensors_close(out["got"], out["want"], where=where)


def _norms(strategy: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Norms of every kind, of all and of part of the gradients, against one process's."""
    _, model, _, plain, _ = _setup(strategy)
    _backward(model, plain, 0)
    mine = [p.grad for p in model.parameters() if p.grad is not None]
    theirs = [p.grad for p in plain.parameters() if p.grad is not None]
    out = []
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        for foreach in (None, True, False):
            out.append((f"all p={norm_type} foreach={foreach}",
                        torch.nn.utils.get_total_norm(mine, norm_type, foreach=foreach),
                        torch.nn.utils.get_total_norm(theirs, norm_type, foreach=foreach)))
    # Part of the parameters: one shard's gradient is its flat's parameters' gradient.
    flat = model.flats[0]
    names = [slot.fqn for slot in flat.slots]
    out.append((f"part {names}", torch.nn.utils.get_total_norm([flat.shard.grad]),
                torch.nn.utils.get_total_norm([plain.get_parameter(n).grad for n in names])))
    # torch's own clip_grad_norm_, as a reference taken before the model was set up
    out.append(("reference taken earlier",
                grad_norm._ORIGINAL["clip"](model.parameters(), 1e9),
                torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)))
    return out


@pytest.mark.parametrize(("strategy", "n", "nodes"), [("zero3", 3, 1), ("hsdp", 4, 2)])
def test_total_norms_of_shards_match_one_process(strategy: str, n: int, nodes: int) -> None:
    for rank, out in enumerate(run_on_ranks(_norms, n, args=(strategy,), nnodes=nodes)):
        for what, got, want in out:
            _close(got, want, f"{strategy} rank {rank}: {what}")


def _zero2_part() -> tuple[torch.Tensor, torch.Tensor]:
    """clip_grad_norm_ over some parameters: each owned by one rank, the others join."""
    _, model, _, plain, _ = _setup("zero2")
    _backward(model, plain, 0)
    return (torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1e9),
            torch.nn.utils.clip_grad_norm_(list(plain.parameters())[:2], 1e9))


def test_clipping_part_of_zero2_parameters_matches_one_process() -> None:
    for rank, (got, want) in enumerate(run_on_ranks(_zero2_part, 3)):
        _close(got, want, f"zero2 rank {rank}")


def _attempt(call: Any) -> str:
    try:
        call()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _refusals(strategy: str) -> dict[str, str]:
    grad_norm._install()  # as after any earlier zero2/zero3 setup in this process
    _, model, _, plain, _ = _setup(strategy)
    _backward(model, plain, 0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    out = {}
    if strategy == "zero3":  # elsewhere it replaces the parameters' storage (not tested here)
        out["vector_to_parameters"] = _attempt(lambda: vector_to_parameters(
            parameters_to_vector(plain.parameters()), model.parameters()))
    return out | {
        "parameters_to_vector": _attempt(lambda: parameters_to_vector(model.parameters())),
        "gradients_to_vector": _attempt(lambda: parameters_to_vector(grads)),
        "module clip_grad_norm_": _attempt(lambda: torch.nn.utils.clip_grad_norm_(
            model.module.parameters(), 1e9)),
        "module clip_grad_value_": _attempt(lambda: torch.nn.utils.clip_grad_value_(
            model.module.parameters(), 1e9)),
        "get_total_norm": _attempt(lambda: torch.nn.utils.get_total_norm(grads)),
        "norm_type 0": _attempt(lambda: torch.nn.utils.clip_grad_norm_(
            model.parameters(), 1e9, norm_type=0)),
        "reference taken earlier": _attempt(lambda: grad_norm._ORIGINAL["total"](grads)),
    }


REFUSED = {  # what each strategy refuses (pattern of the message), the rest works
    "zero3": {"parameters_to_vector": "slice of each parameter.*full_parameters",
              "vector_to_parameters": "slice of each parameter.*load_state_dict",
              "gradients_to_vector": "split across ranks.*clip_grad_norm_",
              "norm_type 0": "only a positive norm_type",
              "reference taken earlier": "imported by name.*through the module"},
    "zero2": {"gradients_to_vector": "split across ranks",
              "norm_type 0": "only a positive norm_type",
              "reference taken earlier": "imported by name"},
    "ddp": {},
}


@pytest.mark.parametrize("strategy", sorted(REFUSED))
def test_what_cannot_be_right_raises_and_says_what_to_call(strategy: str) -> None:
    for rank, out in enumerate(run_on_ranks(_refusals, 3, args=(strategy,))):
        for call, message in out.items():
            pattern = REFUSED[strategy].get(call)
            if pattern is None:
                assert message == "ok", f"{strategy} rank {rank} {call}: {message}"
            else:
                assert message != "ok", f"{strategy} rank {rank} {call} did not raise"
                assert re.search(pattern, message), message
