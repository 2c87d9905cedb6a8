"""Betty 0.2.1's own example programs, ported (tests/betty_programs/nas.py, lbi.py,
logreg_hpo.py, bert_reweight.py, pruning.py, sanas.py, tutorials.py; each module's docstring
says what was kept and what was shrunk), run on Betty 0.2.1 itself and on
metadist.compat.betty with only the imports changed. A case is a port with its keyword
arguments (a tutorial, a hypergradient method, the upper problem on plain SGD: Adam would
normalise a wrong hypergradient scale away).

(a) One process each, float64: compat computes Betty's numbers, from the initial weights
    (built by the programs' own configure_module hooks and constructors, drawing from the
    global generator in the order Betty draws) through every problem's final parameters,
    the BatchNorm running statistics, the logged losses, the step counts and the learning
    rates.
(b) compat on 2 ranks ("distributed", "zero", "fsdp"; BatchNorm synchronised where the models
    have it) computes what compat computes in one process, every rank holding bit-identical
    parameters and buffers.

Betty runs only in processes of this module's own pools (tests/peers.py): a one-process pool
runs both implementations of a port (module-scoped, shared by (a) and (b)), a 2-rank pool the
multi-rank runs; a pool is reopened after a job that failed.
"""

from __future__ import annotations

import importlib
import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import peers

# case -> (port, keyword arguments of its run)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "nas": ("nas", {}),
    "lbi": ("lbi", {}),
    "logreg_hpo": ("logreg_hpo", {}),
    **{f"logreg_hpo-{m}-sgd": ("logreg_hpo", {"method": m, "momentum": 0.0})
       for m in ("cg", "darts", "neumann", "sama")},
    "bert_reweight": ("bert_reweight", {}),
    "tutorial1": ("tutorials", {"tutorial": 1}),
    "tutorial1-baseline": ("tutorials", {"tutorial": 1, "baseline": True}),
    "tutorial2-sgd": ("tutorials", {"tutorial": 2, "upper_sgd": True}),
    "tutorial3": ("tutorials", {"tutorial": 3}),
    "tutorial4": ("tutorials", {"tutorial": 4}),
    "tutorial5": ("tutorials", {"tutorial": 5}),
    "pruning": ("pruning", {}),
    "pruning-sgd": ("pruning", {"upper_sgd": True}),
    "sanas": ("sanas", {}),
    "sanas-sgd": ("sanas", {"upper_sgd": True}),
}
STRATEGIES = ("distributed", "zero", "fsdp")
# (b)'s cases: every port under every strategy, once on Adam and once on plain SGD where it
# has both (the other one-process cases differ from these only in what (a) checks); SANAS
# on plain SGD, the slowest, under "fsdp" alone (its roll_back over shards)
ON_RANKS = [(c, s) for c in ("nas", "lbi", "logreg_hpo", "logreg_hpo-sama-sgd",
                             "bert_reweight", "tutorial2-sgd", "tutorial5", "pruning",
                             "pruning-sgd", "sanas") for s in STRATEGIES] + [("sanas-sgd", "fsdp")]
JOB_TIMEOUT = 240.0

# (a) Betty vs compat, both float64 in one process. One rounding is 1.1e-16 relative; the
# programs amplify a rounding difference (another, equally valid order of the same floating
# point operations) by what they do with it: Betty's darts divides a difference of two
# gradients by 2 eps = 0.02 / |v|, Adam divides by sqrt(v), cg by p.Hp, and a few steps
# compound it. Measured: perturbing every initial weight by one ulp moves Betty's final
# states by at most 1.5e-15 absolute, 2e-13 relative on entries >= 1e-6 in magnitude (1e-11
# on one BatchNorm bias of lbi's reweight, itself ~1e-4); compat where it computes Betty's
# numbers agrees with Betty to 2.3e-15 absolute, 1.7e-12 relative on entries >= 1e-6 (lbi's
# reweight again; 1e-13 and less elsewhere). rtol 1e-10 with atol 1e-12 stays about two
# orders of magnitude above that, and seven and more below what a modelling difference
# produces in these ports (another batch order, another initialisation, a missing
# hypergradient term, unsynchronised BatchNorm: 5e-3 .. 1e+2 relative).
RTOL_BETTY, ATOL_BETTY = 1e-10, 1e-12
# (b) 2 ranks vs one process: the ranks sum their halves of each batch's gradient in another
# order than one process sums the whole (and synchronised BatchNorm its statistics): the same
# kind of rounding difference, measured at 5e-15 absolute, 6e-11 relative on entries >= 1e-6
# (the small BatchNorm biases of lbi's reweight, which carry darts' 1/eps; 5e-12 and less
# elsewhere). tests/parity.py's fp32 tolerances (rtol 1.3e-6, atol 1e-5) would hide real
# differences in float64: with learning rates of 1e-4 .. 1e-3 and a few steps many
# parameters move by less than 1e-5 in all. rtol 1e-9, atol 1e-12.
RTOL_RANKS, ATOL_RANKS = 1e-9, 1e-12
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

# What each case must have exercised on Betty, lest a shrunk port compare nothing: the upper
# problem stepped (at least 3 times), and the port's particular path ran.
def _tutorial(r: dict[str, Any], tutorial: int) -> bool:
    """12 steps of both problems, the MultiStepLR past both milestones, and what the
    tutorial adds: its own scoring (1), 3 validations (2..5), logged dict results (3..5)."""
    return (r["counts"] == {"reweight": 12, "classifier": 12}
            and r["lr"]["classifier"] == pytest.approx([(0.01 if tutorial >= 4 else 0.1) * 0.01])
            and (len(r["validations"]) == 3) == (tutorial >= 2)
            and bool(r["losses"]) == (tutorial >= 3) and ("accuracy" in r) == (tutorial == 1))


def _moved(r: dict[str, Any], problem: str) -> float:
    """How far the upper problem's parameters moved (a plain-SGD upper must move)."""
    return max(float((r["final"][k] - r["initial"][k]).abs().max())
               for k in r["final"] if k.startswith(problem + "."))


def _pruning(r: dict[str, Any]) -> bool:
    """6 outer steps over 12 inner ones; the inner read ``_global_step`` at each of its steps
    and twice in each darts hypergradient (24 reads); ``ema_update`` after every inner step
    (``fc_ema`` ends as ``fc``, which moved); 3 validations; the filter ranked all 32
    samples; the MultiStepLR past both milestones."""
    final = r["final"]
    return (r["counts"] == {"inner": 12, "outer": 6}
            and sorted(set(r["global_steps"])) == list(range(1, 13))
            and len(r["global_steps"]) == 24 and r["ema_updates"] == list(range(1, 13))
            and torch.allclose(final["inner.fc_ema.weight"], final["inner.fc.weight"])
            and not torch.allclose(r["initial"]["inner.fc.weight"], final["inner.fc.weight"])
            and [v["step"] for v in r["validations"]] == [4, 8, 12]
            and sorted(r["sorted_idx"]) == list(range(32))
            and r["lr"]["inner"] == pytest.approx([1e-3]))


def _sanas(r: dict[str, Any]) -> bool:
    """3 iterations of the four levels; 6 attacks at each of inner2's steps (the step, 4 in
    darts' finite differences, the retake after roll_back); one validation; both cosine
    schedules run out."""
    return (r["counts"] == {"outer": 3, "inner2": 3, "inner1": 3}
            and r["attacks"] == [c for c in (1, 2, 3) for _ in range(6)]
            and [v[0] for v in r["validations"]] == [2]
            and r["lr"]["inner1"] == r["lr"]["inner2"] == pytest.approx([0.0], abs=1e-12))


EXERCISED: dict[str, Callable[[dict[str, Any]], bool]] = {
    # 4 searches, each rolled back; validation (eval mode) twice
    "nas": lambda r: r["counts"] == {"arch": 4, "classifier": 4} and len(r["validations"]) == 2,
    # StepLR(2, 0.1) stepped 4 times on every problem's two groups
    "lbi": lambda r: r["counts"]["reweight"] == 4
    and all(lrs == pytest.approx([1e-6, 1e-5]) for lrs in r["lr"].values()),
    # 16 cg hypergradients; param_callback's clamp raised entries to the floor
    "logreg_hpo": lambda r: r["counts"] == {"outer": 16, "inner": 80} and any(r["clamped"]),
    **{f"logreg_hpo-{m}-sgd": lambda r: r["counts"] == {"outer": 16, "inner": 80}
       and _moved(r, "outer") > 0.1 for m in ("cg", "darts", "neumann", "sama")},
    # 4 reweightings over windows of 2; the warmup-then-linear schedule ran out
    "bert_reweight": lambda r: r["counts"] == {"reweight": 4, "finetune": 8}
    and r["lr"]["finetune"] == [0.0],
    "tutorial1": lambda r: _tutorial(r, 1),
    "tutorial1-baseline": lambda r: r["counts"] == {"classifier": 12} and "accuracy" in r,
    "tutorial2-sgd": lambda r: _tutorial(r, 2) and _moved(r, "reweight") > 0.1,
    "tutorial3": lambda r: _tutorial(r, 3),
    "tutorial4": lambda r: _tutorial(r, 4),
    "tutorial5": lambda r: _tutorial(r, 5),
    "pruning": _pruning,
    "pruning-sgd": lambda r: _pruning(r) and _moved(r, "outer") > 1e-3,
    "sanas": _sanas,
    "sanas-sgd": lambda r: _sanas(r) and _moved(r, "outer") > 1e-2,
}


# ----- the jobs (module level: they run in the pools' processes) --------------------------------

def _attempt(case: str, impl: str, strategy: str) -> dict[str, Any]:
    """The case's result, or {"error": traceback} (a failure must not close the pool, and
    the other implementation's result is still wanted)."""
    port, kwargs = CASES[case]
    try:
        return importlib.import_module(f"betty_programs.{port}").run(impl, strategy, **kwargs)
    except Exception:
        return {"error": f"{impl} ({strategy}) raised:\n{traceback.format_exc()}"}


def _both_in_one_process(case: str) -> dict[str, dict[str, Any]]:
    peers.use()
    peers.quiet_betty()
    return {impl: _attempt(case, impl, "default") for impl in ("betty", "compat")}


def _compat_on_ranks(case: str, strategy: str) -> dict[str, Any]:
    peers.use()  # the ports import only the compat layer here; the path is harmless
    return _attempt(case, "compat", strategy)


# ----- pools and comparisons ---------------------------------------------------------------

@pytest.fixture(scope="module")
def one_process() -> Iterator[Callable[[str], dict[str, dict[str, Any]]]]:
    """case -> {"betty": result, "compat": result}, each case run once per module."""
    pool, done = peers.Reopening(1, JOB_TIMEOUT), {}

    def get(case: str) -> dict[str, dict[str, Any]]:
        if case not in done:
            done[case] = pool.run(_both_in_one_process, case)[0]
        return done[case]

    try:
        yield get
    finally:
        pool.close()


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[peers.Reopening]:
    pool = peers.Reopening(2, JOB_TIMEOUT)
    try:
        yield pool
    finally:
        pool.close()


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result


def _kind(name: str) -> str:
    return "buffers" if name.endswith(BUFFERS) else "parameters"


def _differences(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max absolute difference, max relative difference over the entries >= 1e-6 in
    magnitude: a relative difference of entries that are zero up to rounding says nothing)."""
    if got.shape != want.shape:
        return math.inf, math.inf
    if not want.is_floating_point():
        return (0.0, 0.0) if torch.equal(got, want) else (math.inf, math.inf)
    if not want.numel():
        return 0.0, 0.0
    diff = (got - want).abs()
    sizable = want.abs() >= 1e-6
    rel = float((diff[sizable] / want.abs()[sizable]).max()) if sizable.any() else 0.0
    return float(diff.max()), rel


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], section: str,
             rtol: float, atol: float) -> list[str]:
    """What is beyond tolerance, by "<problem> <parameters|buffers>", with that group's
    largest differences."""
    problems: list[str] = []
    if got.keys() != want.keys():
        return [f"{section}: names differ: {sorted(got.keys() ^ want.keys())}"]
    worst: dict[str, tuple[float, float]] = {}
    beyond: dict[str, list[str]] = {}
    for name, w in want.items():
        g = got[name]
        group = f"{name.split('.', 1)[0]} {_kind(name)}"
        absolute, relative = _differences(g, w)
        before = worst.get(group, (0.0, 0.0))
        worst[group] = (max(before[0], absolute), max(before[1], relative))
        close = (g.shape == w.shape and (torch.equal(g, w) if not w.is_floating_point()
                                         else bool(torch.isclose(g, w, rtol, atol).all())))
        if not close:
            beyond.setdefault(group, []).append(name.split(".", 1)[1])
    for group, names in beyond.items():
        absolute, relative = worst[group]
        problems.append(f"{section} {group}: max relative difference {relative:.3g} (max "
                        f"absolute {absolute:.3g}), {len(names)} tensor(s) beyond rtol "
                        f"{rtol:g}/atol {atol:g} (e.g. {names[0]})")
    return problems


def _compare_losses(got: list[tuple[str, int, float]], want: list[tuple[str, int, float]]
                    ) -> list[str]:
    if [(n, c) for n, c, _ in got] != [(n, c) for n, c, _ in want]:
        return [f"logged steps differ: {[(n, c) for n, c, _ in got]} != "
                f"{[(n, c) for n, c, _ in want]}"]
    out = []
    for (name, count, g), (_, _, w) in zip(got, want, strict=True):
        if not math.isclose(g, w, rel_tol=RTOL_BETTY, abs_tol=ATOL_BETTY):
            out.append(f"loss of {name} at its step {count}: {g!r} != {w!r} "
                       f"(relative {abs(g - w) / abs(w):.3g})")
            break  # the first one says where the runs part
    return out


def _compare_records(what: str, got: Any, want: Any) -> list[str]:
    """Records compared exactly; a list's first differing entry is named."""
    if got == want:
        return []
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        i = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
        return [f"{what}[{i}]: {got[i]!r} != {want[i]!r}"]
    return [f"{what}: {got!r} != {want!r}"]


def _compare_lr(got: dict[str, list[float]], want: dict[str, list[float]]) -> list[str]:
    """Learning rates per problem and parameter group (the schedulers' closed forms)."""
    return [f"learning rates of {name}: {got.get(name)} != {lrs}" for name, lrs in want.items()
            if got.get(name) is None or len(got[name]) != len(lrs)
            or not all(math.isclose(g, w, rel_tol=1e-12)
                       for g, w in zip(got[name], lrs, strict=True))]


# ----- (a) Betty 0.2.1 vs compat, one process ------------------------------------------------

@pytest.mark.parametrize("port", CASES)
def test_port_equals_betty(one_process: Callable[[str], dict[str, dict[str, Any]]],
                           port: str) -> None:
    """The port on compat computes what it computes on Betty 0.2.1, to float64 rounding:
    initial weights, final parameters and BatchNorm statistics of every problem, the logged
    losses, counts, learning rates and the port's own records (validations, clamps)."""
    runs = one_process(port)
    want = _ok(runs["betty"])
    assert EXERCISED[port](want), f"{port} on Betty no longer runs what it was written to"
    got = _ok(runs["compat"])
    failures: list[str] = []
    for section in ("initial", "final"):
        failures += _compare(got[section], want[section], section, RTOL_BETTY, ATOL_BETTY)
    failures += _compare_losses(got["losses"], want["losses"])
    if got["counts"] != want["counts"]:
        failures.append(f"counts {got['counts']} != Betty's {want['counts']}")
    failures += _compare_lr(got["lr"], want["lr"])
    for extra in sorted(set(want) - {"initial", "final", "losses", "counts", "lr"}):
        failures += _compare_records(extra, got.get(extra), want[extra])
    assert not failures, f"{port}: compat differs from Betty 0.2.1:\n  " + "\n  ".join(failures)


# ----- (b) compat on 2 ranks vs compat in one process ----------------------------------------

# nas and sanas under "fsdp": roll_back caches and restores sharded state (before: refused
# in the drop-in's own cache_states, a deep copy of the shards)
@pytest.mark.parametrize(("port", "strategy"), ON_RANKS)
def test_port_on_two_ranks_equals_one_process(
        one_process: Callable[[str], dict[str, dict[str, Any]]], two_ranks: peers.Reopening,
        port: str, strategy: str) -> None:
    """2 ranks, each reading its half of every global batch (per-rank batch sizes halved),
    end where one process ends: initial and final parameters and BatchNorm statistics,
    counts, learning rates; every rank bit-identical."""
    want = _ok(one_process(port)["compat"])
    ranks = [_ok(r) for r in two_ranks.run(_compat_on_ranks, port, strategy)]
    failures: list[str] = []
    for rank, got in enumerate(ranks):
        where = f"rank {rank}"
        for section in ("initial", "final"):
            failures += _compare(got[section], want[section], f"{where} {section}",
                                 RTOL_RANKS, ATOL_RANKS)
        if got["counts"] != want["counts"]:
            failures.append(f"{where}: counts {got['counts']} != {want['counts']}")
        failures += [f"{where}: {m}" for m in _compare_lr(got["lr"], want["lr"])]
        if "clamped" in want and got["clamped"] != want["clamped"]:
            failures.append(f"{where}: param_callback clamped {got['clamped']} != "
                            f"{want['clamped']}")
    for section in ("initial", "final"):
        for name, value in ranks[0][section].items():
            if name in ranks[1][section] and not torch.equal(ranks[1][section][name], value):
                failures.append(f"rank 1's {section} {name} is not rank 0's (max abs "
                                f"difference {(ranks[1][section][name] - value).abs().max():.3g})")
    assert not failures, (f"{port} on 2 ranks ({strategy}) differs from one process:\n  "
                          + "\n  ".join(failures))
