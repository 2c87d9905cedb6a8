"""Second-order MAML in the peers' own idioms, on the model ``strategy.setup`` returns.

A learn2learn program (``MAML(model, lr)``, ``maml.clone()``, ``learner.adapt(loss)``) and a
higher program (``higher.innerloop_ctx(model, SGD(model.parameters()),
copy_initial_weights=False)``, ``diffopt.step(loss)``) are wired exactly as the README wires a
model: ``model, opt = strategy.setup(net, opt)``, then the library is handed ``model``. Each
runs on this rank's contiguous slice of tasks (tests/idioms.py's sinusoid tasks, tanh MLP,
outer Adam) under single (1 rank), ddp, zero1, zero2, zero3 (2 ranks) and hsdp (2 simulated
nodes x 1 rank), and is compared with one plain PyTorch process (no metadist) running the same
library's idiom on the plain module over all the tasks.

Every cell is either "equal to one process" (tests/parity.py's fp32 tolerances after
OUTER_STEPS outer steps, every rank holding bit-identical parameters) or "a clear error"
whose message names the path the program took and the portable form (``full_parameters``).
No cell may run and differ.

Peers only ever live in processes of this module's own pools (tests/peers.py): one pool per
world layout, reopened after a cell that fails (a failed job closes its pool). The plain
references run in one spawned process of their own.
"""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import metadist
import peers
from idioms import INNER_LR, INNER_STEPS, OUTER_STEPS, TASKS, maml_net, maml_reference, maml_tasks
from metadist.errors import RankFailedError
from parity import ATOL, RTOL, assert_tensors_close, loss_fn

Params = dict[str, Tensor]
Task = tuple[Tensor, ...]

OUTER_LR = 1e-2
JOB_TIMEOUT = 120.0

# Tiny buckets / units so the 25-parameter net splits into several owners and units
# (tests/test_same_code.py's options).
OPTIONS: dict[str, dict[str, Any]] = {
    "single": {}, "ddp": {}, "zero1": {},
    "zero2": {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0005},
    "zero3": {"min_unit_params": 10},
    "hsdp": {"min_unit_params": 10},
}
# (world size, simulated nodes): hsdp at 2 ranks = 2 nodes x 1 rank.
LAYOUT = {"single": (1, 1), "ddp": (2, 1), "zero1": (2, 1), "zero2": (2, 1), "zero3": (2, 1),
          "hsdp": (2, 2)}

# How the outer backward is written: learn2learn programs call it once on the mean query loss
# (``loss.backward()`` or ``strategy.backward(loss)``); higher programs either call it per task
# on ``query / len(tasks)`` inside the ``innerloop_ctx`` or once on the accumulated mean.
L2L_BACKWARDS = ("loss.backward", "strategy.backward")
HIGHER_BACKWARDS = ("per_task", "mean")


# ----- the idioms, on the plain module or on the wrapped one ------------------------------------

def _l2l_step(maml: nn.Module, tasks: list[Task]) -> Tensor:
    """learn2learn: a clone per task, INNER_STEPS adapt calls, mean query loss."""
    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        learner = maml.clone()  # type: ignore[operator]
        for _ in range(INNER_STEPS):
            learner.adapt(loss_fn(learner(xs), ys))
        total = total + loss_fn(learner(xq), yq)
    return total / len(tasks)


def _higher_step(model: nn.Module, tasks: list[Task], per_task: bool) -> None:
    """higher: an ``innerloop_ctx`` per task on the model's own weights; the query loss is
    back-propagated per task (``/ len(tasks)``) or accumulated and back-propagated once."""
    import higher

    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        inner_opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (fmodel,
                                                                                     diffopt):
            for _ in range(INNER_STEPS):
                diffopt.step(loss_fn(fmodel(xs), ys))
            query = loss_fn(fmodel(xq), yq) / len(tasks)
            if per_task:
                query.backward()
            else:
                total = total + query
    if not per_task:
        total.backward()


def _slice(step: int, rank: int, world: int) -> list[Task]:
    per = TASKS // world
    return maml_tasks(step)[rank * per:(rank + 1) * per]


def _on_rank(strategy: str, train: Callable[[metadist.Strategy, nn.Module, list[Task]], None]
             ) -> Params:
    """setup as the README shows it, OUTER_STEPS outer steps of ``train`` on this rank's
    tasks, then the full parameters by the user's module's names."""
    w = metadist.world()
    net = maml_net()
    s = metadist.strategy(strategy, **OPTIONS[strategy])
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=OUTER_LR))
    for step in range(OUTER_STEPS):
        opt.zero_grad()
        train(s, model, _slice(step, w.rank, w.world_size))
        opt.step()
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


def l2l_on_rank(strategy: str, backward: str) -> Params:
    peers.use(torchvision_standin=True)
    import learn2learn as l2l

    maml: nn.Module | None = None

    def train(s: metadist.Strategy, model: nn.Module, tasks: list[Task]) -> None:
        nonlocal maml
        if maml is None:  # created once, after setup, on the model setup returned
            maml = l2l.algorithms.MAML(model, lr=INNER_LR, first_order=False)
        loss = _l2l_step(maml, tasks)
        if backward == "strategy.backward":
            s.backward(loss)
        else:
            loss.backward()

    return _on_rank(strategy, train)


def higher_on_rank(strategy: str, backward: str) -> Params:
    peers.use()

    def train(s: metadist.Strategy, model: nn.Module, tasks: list[Task]) -> None:
        _higher_step(model, tasks, backward == "per_task")

    return _on_rank(strategy, train)


def references() -> dict[str, Params]:
    """One plain PyTorch process, every task, each library's idiom on the plain module; plus
    tests/idioms.py's hand-written MAML and learn2learn's first-order MAML, for the guards."""
    peers.use(torchvision_standin=True)
    import learn2learn as l2l

    torch.set_num_threads(1)  # as the ranks run

    def train(step_fn: Callable[[nn.Module, list[Task]], None]) -> Params:
        net = maml_net()
        opt = torch.optim.Adam(net.parameters(), lr=OUTER_LR)
        for step in range(OUTER_STEPS):
            opt.zero_grad()
            step_fn(net, maml_tasks(step))
            opt.step()
        return {n: p.detach().clone() for n, p in net.named_parameters()}

    def l2l_train(first_order: bool) -> Params:
        maml: nn.Module | None = None

        def step_fn(net: nn.Module, tasks: list[Task]) -> None:
            nonlocal maml
            if maml is None:
                maml = l2l.algorithms.MAML(net, lr=INNER_LR, first_order=first_order)
            _l2l_step(maml, tasks).backward()

        return train(step_fn)

    out = {"learn2learn": l2l_train(False), "learn2learn first order": l2l_train(True)}
    out["higher per_task"] = train(lambda net, tasks: _higher_step(net, tasks, True))
    out["higher mean"] = train(lambda net, tasks: _higher_step(net, tasks, False))
    out["hand-written"] = maml_reference()
    return out


# ----- pools and expectations -------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks() -> Iterator[Callable[[str], peers.Reopening]]:
    with peers.layouts(JOB_TIMEOUT) as get:
        yield lambda strategy: get(*LAYOUT[strategy])


@pytest.fixture(scope="module")
def want() -> dict[str, Params]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as executor:
        return executor.submit(references).result(timeout=JOB_TIMEOUT)


PARITY = ("single", "ddp", "zero1", "zero2")
# Fast weights per rank cannot be parameter shards: the error must name the path the program
# took (the library) and the portable form.
RAISES = ("zero3", "hsdp")
STRATEGIES = PARITY + RAISES
LIBRARY = {"learn2learn": r"learn2learn",
           "higher": r"\bhigher\b(?![- ]order)"}  # the library, not "higher-order"

# The cells that raise last, per layout: a failed job closes its pool, so each of them after
# the first of its layout pays a fresh one.
CASES = [(library, b, s) for group in (PARITY, RAISES) for s in group
         for library, backwards in (("learn2learn", L2L_BACKWARDS), ("higher", HIGHER_BACKWARDS))
         for b in backwards]
BODY: dict[str, Callable[[str, str], Params]] = {"learn2learn": l2l_on_rank,
                                                 "higher": higher_on_rank}


@pytest.mark.parametrize(("library", "backward", "strategy"), CASES)
def test_peer_maml_equals_one_process_or_raises_a_clear_error(
        ranks: Callable[[str], peers.Reopening], want: dict[str, Params], library: str,
        backward: str, strategy: str) -> None:
    where = f"{library} ({backward}) under {strategy}"
    job = (BODY[library], strategy, backward)
    if strategy in RAISES:
        with pytest.raises(RankFailedError) as caught:
            ranks(strategy).run(*job)
        assert not caught.value.hung, f"{where}: a hang, not an error:\n{caught.value}"
        message = caught.value.remote_message  # the rank's message, not its traceback
        for pattern in (LIBRARY[library], r"full_parameters"):
            assert re.search(pattern, message), (
                f"{where}: {pattern!r} not in the error's message:\n{caught.value}")
        return
    got = ranks(strategy).run(*job)
    reference = want["learn2learn" if library == "learn2learn" else f"higher {backward}"]
    for rank, params in enumerate(got):
        assert_tensors_close(params, reference, f"{where} rank {rank} vs one process")
        for name, value in params.items():
            assert torch.equal(value, got[0][name]), f"{where}: {name} differs on rank {rank}"


def test_references_are_the_same_second_order_maml(want: dict[str, Params]) -> None:
    """Guards on the references: learn2learn's and higher's idioms compute tests/idioms.py's
    hand-written second-order MAML, and the second-order terms move the result by more than
    the tolerance (first-order MAML would not pass for it)."""
    for name in ("learn2learn", *(f"higher {b}" for b in HIGHER_BACKWARDS)):
        assert_tensors_close(want[name], want["hand-written"], f"{name} vs hand-written")
    first, second = want["learn2learn first order"], want["learn2learn"]
    assert any(not torch.allclose(first[k], second[k], rtol=RTOL, atol=ATOL) for k in second)
