"""The multilevel engine: distributed bilevel training equals one process on the same global
batches (every hypergradient method, ddp and zero3, world sizes 2 and 3), the hypergradient
reaches the optimizer with no collective, rank-0 validation and collective early stopping,
loggers, checkpoints, configuration errors, and the examples.

The bilevel problem: ridge regression whose per-feature decay exp(lam) the upper level learns.
Inner G = mean 1/2 (x.w + b - y)^2 + 1/2 sum_j exp(lam_j) w_j^2; outer F = validation MSE / 2
+ 0.01 |lam|^2 (a direct term, so the direct part of the hypergradient matters too).
"""

from __future__ import annotations

import math
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from metadist import comm
from metadist.meta import (
    CGConfig,
    EarlyStopping,
    Engine,
    EngineConfig,
    NeumannConfig,
    Problem,
    ProblemConfig,
)
from metadist.strategies.fast_weights import FastWeights
from metadist.strategies.tensors.shard_piece import plain, shard_internals
from metadist.testing import run_on_ranks

# The problem is float64; both sides run on the machine running the test and differ only in
# the order sums are taken. Measured here (parameters up to 1.9): at most 2.0e-15 between
# ranks and one process (darts; the others 2.2e-16), 3.5e-17 against the hand-written loop,
# 0.0 for a resumed run. 1e-12 leaves ~500x for another CPU's summation order.
TOL = {"rtol": 1e-12, "atol": 1e-12}
# The exception, a float32 computation inside the float64 problem:
# * a 16-mixed upper level computes its forward in float16/float32 (measured 1.5e-7): the
#   parity protocol's float32 tolerances (tests/parity.py);
FLOAT32 = {"rtol": 1.3e-6, "atol": 1e-5}
ROOT = Path(__file__).resolve().parent.parent
D, BATCH = 5, 12  # global batch of both levels, divisible by 2 and 3
METHODS = ("unrolled", "darts", "neumann", "cg")
ZERO3 = {"min_unit_params": 1}
INNER_LR, OUTER_LR = 0.3, 0.05


def _data(ragged: bool) -> tuple[TensorDataset, TensorDataset]:
    # ragged: the last global batch of each epoch is short, and at 3 ranks one rank of the
    # validation level is left with a stand-in sample of weight 0
    n_train, n_val = (46, 22) if ragged else (48, 36)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_val, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, 1, generator=g, dtype=torch.float64)
    y = x @ w + 0.5 * torch.randn(n_train + n_val, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


class Decay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_decay = nn.Parameter(torch.full((D,), math.log(0.3), dtype=torch.float64))

    def forward(self) -> Tensor:
        return self.log_decay.exp()


class Inner(Problem):
    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        w = self.parameters_dict()["weight"].reshape(-1)
        return 0.5 * ((self(x) - y) ** 2).mean() + 0.5 * (self.hyper() * w**2).sum()


class Hyper(Problem):
    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        lam = self.parameters_dict()["log_decay"]
        return 0.5 * ((self.inner(x) - y) ** 2).mean() + 0.01 * (lam**2).sum()


def _inner_config(method: str) -> ProblemConfig:
    """Each method also exercises one engine feature: an unroll window of 2 steps, gradient
    accumulation (no_sync), explicit method configs."""
    match method:
        case "unrolled":
            return ProblemConfig(method=method, unroll_steps=2)
        case "neumann":
            return ProblemConfig(method=method, gradient_accumulation=2,
                                 hypergrad=NeumannConfig(iterations=5, alpha=INNER_LR))
        case "cg":
            return ProblemConfig(method=method, hypergrad=CGConfig(iterations=5))
    return ProblemConfig(method=method)


def build(method: str, strategy: str = "single", options: dict[str, Any] | None = None, *,
          ragged: bool = False, engine_class: type[Engine] = Engine, first_order: bool = False,
          upper_precision: str | None = None, schedule: bool = False,
          decay_class: type[nn.Module] = Decay, **config: Any) -> Engine:
    """The bilevel ridge problem; loaders take BATCH / world size per rank. The upper level
    steps 10 times by default (after every 2 inner iterations for unrolled and neumann).
    ``schedule``: the inner learning rate halves after 5 steps (a LambdaLR built before
    setup)."""
    n = metadist.init().world_size
    train, val = _data(ragged)
    torch.manual_seed(1)
    linear, decay = nn.Linear(D, 1).double(), decay_class()
    opt = torch.optim.SGD(linear.parameters(), lr=INNER_LR)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 5 else 0.5)
                 if schedule else None)
    inner = Inner("inner", linear, opt, scheduler,
                  train_data_loader=DataLoader(train, batch_size=BATCH // n, shuffle=True),
                  config=(ProblemConfig(first_order=True) if first_order
                          else _inner_config(method)))
    hyper = Hyper("hyper", decay, torch.optim.Adam(decay.parameters(), lr=OUTER_LR),
                  train_data_loader=DataLoader(val, batch_size=BATCH // n, shuffle=True),
                  config=ProblemConfig(gradient_clipping=0.5 if method == "cg" else None,
                                       precision=upper_precision))
    config.setdefault("train_iters", 20 if method in ("unrolled", "neumann") else 10)
    return engine_class([inner, hyper], EngineConfig(strategy=strategy,
                                                     strategy_options=options or {}, **config),
                        {"u2l": {hyper: [inner]}, "l2u": {inner: [hyper]}})


def final(engine: Engine) -> dict[str, Tensor]:
    return {f"{p.name}.{n}": t.clone() for p in engine.problems.values()
            for n, t in p.params().items()}


def _trained(method: str, strategy: str, options: dict[str, Any], ragged: bool
             ) -> tuple[dict[str, Tensor], int]:
    engine = build(method, strategy, options, ragged=ragged)
    engine.run()
    return final(engine), engine.problems["hyper"].steps


def _train_cases(cases: list[tuple[str, str, dict[str, Any], bool]]) -> list[Any]:
    return [_trained(*case) for case in cases]


def _close(got: dict[str, Tensor], want: dict[str, Tensor], where: str,
           tol: dict[str, float] = TOL) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tol,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, bool], dict[str, Tensor]]:
    out = {}
    was_initialized = metadist.is_initialized()
    for method in METHODS:
        for ragged in (False, True):
            params, steps = _trained(method, "single", {}, ragged)
            assert steps == 10
            out[(method, ragged)] = params
    if not was_initialized:
        metadist.shutdown()  # the single-process references ran in the pytest process
    return out


# ws 2: every method under ddp and zero3, two under zero1/zero2 (parameters refreshed after
# step() are read through the wrapper); ws 3: the same plus ragged global batches.
CASES = {
    2: [(m, s, o, False) for m in METHODS for s, o in (("ddp", {}), ("zero3", ZERO3))]
    + [("darts", "zero1", {}, False), ("cg", "zero2", {}, False)],
    3: [(m, s, o, False) for m in METHODS for s, o in (("ddp", {}), ("zero3", ZERO3))]
    + [("neumann", "ddp", {}, True), ("cg", "zero3", ZERO3, True),
       ("unrolled", "ddp", {}, True)],
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_bilevel_training_matches_single_process(
        world_size: int, references: dict[tuple[str, bool], dict[str, Tensor]]) -> None:
    cases = CASES[world_size]
    out = run_on_ranks(_train_cases, world_size, args=(cases,), timeout=300)
    for rank, results in enumerate(out):
        for (method, strategy, _, ragged), (got, steps) in zip(cases, results, strict=True):
            where = f"{method} {strategy} ws={world_size} ragged={ragged} rank={rank}"
            assert steps == 10, where
            _close(got, references[(method, ragged)], where)


@pytest.mark.parametrize(("strategy", "nnodes"), [("zero3", 1), ("hsdp", 2)])
def test_bilevel_training_on_shards_at_four_ranks(
        strategy: str, nnodes: int,
        references: dict[tuple[str, bool], dict[str, Tensor]]) -> None:
    """Under zero3/hsdp the engine's hypergradients run on the lower problem's shards as
    fast weights (strategies/zero3/sharded_fast.py): the same results at 4 ranks, hsdp 2 x 2."""
    cases = [(m, strategy, ZERO3, False) for m in ("unrolled", "neumann", "cg")]
    out = run_on_ranks(_train_cases, 4, args=(cases,), nnodes=nnodes, timeout=300)
    for rank, results in enumerate(out):
        for (method, _, _, _), (got, steps) in zip(cases, results, strict=True):
            where = f"{method} {strategy} ws=4 rank={rank}"
            assert steps == 10, where
            _close(got, references[(method, False)], where)


def test_unrolled_engine_equals_hand_written_bilevel_loop() -> None:
    """Plain PyTorch: two real SGD steps of the inner problem, then the upper gradient by
    autograd through the same two steps (replayed from the window's start) plus the direct
    term; Adam on the decay. The engine must reproduce it."""
    engine = build("unrolled")
    engine.run()
    train, val = _data(False)
    single = metadist.strategy("single")  # the same per-epoch batch order as the engine's

    def cycle(data: TensorDataset) -> Any:
        loader = single.setup_dataloader(DataLoader(data, batch_size=BATCH, shuffle=True))
        while True:
            yield from loader  # each pass is the next epoch

    inner_batches, val_batches = cycle(train), cycle(val)
    torch.manual_seed(1)
    w0 = nn.Linear(D, 1).double()
    w, b = w0.weight.detach().reshape(-1).clone(), w0.bias.detach().clone()
    lam = torch.full((D,), math.log(0.3), dtype=torch.float64, requires_grad=True)
    adam = torch.optim.Adam([lam], lr=OUTER_LR)

    def inner_loss(w: Tensor, b: Tensor, lam: Tensor, batch: Any) -> Tensor:
        x, y = batch
        return 0.5 * ((x @ w + b - y.reshape(-1)) ** 2).mean() + 0.5 * (lam.exp() * w**2).sum()

    for _ in range(10):
        batches = [next(inner_batches) for _ in range(2)]
        start = (w, b)
        for batch in batches:  # the real steps
            wg, bg = torch.autograd.grad(inner_loss(w.requires_grad_(), b.requires_grad_(),
                                                    lam.detach(), batch), (w, b))
            w, b = (w - INNER_LR * wg).detach(), (b - INNER_LR * bg).detach()
        fw, fb = (t.clone().requires_grad_() for t in start)
        for batch in batches:  # the replay, differentiable in lam
            wg, bg = torch.autograd.grad(inner_loss(fw, fb, lam, batch), (fw, fb),
                                         create_graph=True)
            fw, fb = fw - INNER_LR * wg, fb - INNER_LR * bg
        xv, yv = next(val_batches)
        outer = 0.5 * ((xv @ fw + fb - yv.reshape(-1)) ** 2).mean() + 0.01 * (lam**2).sum()
        adam.zero_grad()
        (lam.grad,) = torch.autograd.grad(outer, lam)
        adam.step()
    got = final(engine)
    want = {"inner.weight": w.reshape(1, -1), "inner.bias": b, "hyper.log_decay": lam.detach()}
    _close(got, want, "unrolled vs hand-written")


# ----- how the hypergradient reaches the optimizer ---------------------------------------
def _landing() -> dict[str, bool]:
    out = {}
    for strategy, options in (("ddp", {}), ("zero3", ZERO3)):
        engine = build("darts", strategy, options, train_iters=3)
        engine.run()
        hyper = engine.problems["hyper"]
        hyper.batch = hyper.next_batch()
        grads = engine._hypergradient(hyper)  # averaged over ranks, identical everywhere
        stepped = [p for g in hyper.optimizer.param_groups for p in g["params"]]
        with comm.stats.counting() as landing:
            hyper.accumulate_grads(grads)
        if strategy == "zero3":  # this rank's piece of the flat buffer, padded 5 -> 6
            assert isinstance(grads, FastWeights) and len(grads.pieces) == 1, grads
            piece = plain(grads.pieces[0])
            want = torch.nn.functional.pad(piece, (0, 3 - piece.numel()))
        else:
            assert isinstance(grads, dict), grads
            want = grads["log_decay"]
        with shard_internals():  # a shard compared as the test knows it
            out[f"{strategy} lands exactly"] = torch.equal(stepped[0].grad, want)
        with comm.stats.counting() as step:
            hyper.optimizer.step()  # the reducer must not re-average (or sync anything)
        # zero3: only the per-step all-reduce of which parameters have a gradient (one
        # byte per parameter: log_decay), which the landing recorded (strategies/zero3/unreached.py)
        flags = {"all_reduce": 1} if strategy == "zero3" else {}
        out[f"{strategy} no collective"] = landing.calls == 0 and {
            op: s.calls for op, s in step.ops.items()} == flags and step.bytes == len(flags)
    return out


def test_hypergradient_lands_in_the_optimizer_without_a_collective() -> None:
    for rank, checks in enumerate(run_on_ranks(_landing, 2)):
        assert all(checks.values()), f"rank {rank}: {checks}"


def _landing_after_replacement(strategy: str) -> bool:
    engine = build("darts", strategy, train_iters=1)
    engine.run()
    hyper = engine.problems["hyper"]
    # A parameter replaced after setup (load_state_dict(assign=True) does this), and the
    # optimizer pointed at the new tensor: the gradient must land there, not in the old one.
    net = hyper.module.module
    new = nn.Parameter(net.log_decay.detach().clone())
    net.load_state_dict({"log_decay": new}, assign=True)
    hyper.optimizer.param_groups[0]["params"] = [net.log_decay]
    g = torch.arange(float(D), dtype=torch.float64)
    hyper.accumulate_grads({"log_decay": g})
    return net.log_decay.grad is not None and torch.equal(net.log_decay.grad, g)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_hypergradient_lands_in_a_parameter_replaced_after_setup(strategy: str) -> None:
    assert run_on_ranks(_landing_after_replacement, 1, args=(strategy,)) == [True]


class ScaledDecay(Decay):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))  # 0-dim


def _landing_in_a_scalar(strategy: str) -> list[float | None]:
    engine = build("darts", strategy, ZERO3 if strategy == "zero3" else {}, train_iters=1,
                   decay_class=ScaledDecay)
    engine.run()
    hyper = engine.problems["hyper"]
    for p in hyper.trainable():
        p.grad = None
    hyper.accumulate_grads({"scale": torch.tensor(2.0, dtype=torch.float64)})
    # Which rank's optimizer steps it varies by strategy: the landed values, summed over the
    # stepped tensors (zero3: the shard holding it), must give 2 on exactly one place.
    with shard_internals():  # zero3: sums over shards, as the test means them
        return [float(p.grad.sum()) if p.grad is not None else None
                for p in hyper.trainable()]


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero3"])
def test_hypergradient_lands_in_a_0_dim_parameter(strategy: str) -> None:
    landed = run_on_ranks(_landing_in_a_scalar, 1, args=(strategy,))[0]
    assert [g for g in landed if g is not None] == [2.0], landed


# ----- validation and early stopping ------------------------------------------------------
class Validated(Engine):
    def validation(self) -> dict[str, float]:
        self.calls = getattr(self, "calls", 0) + 1
        if getattr(self, "fail", False):
            raise ValueError("broken metric")
        x, y = _data(False)[1].tensors
        with torch.no_grad():  # the replica: a plain module, no collective possible
            assert not isinstance(self.inner.module, metadist.DistributedModule)
            mse = ((self.inner(x) - y) ** 2).mean().item()
        self.replica = {n: t.clone() for n, t in self.inner.module.state_dict().items()}
        return {"loss": 1.0, "mse": mse}  # a loss that never improves


def _validate_and_stop() -> list[Any]:
    out: list[Any] = []
    for strategy, options in (("ddp", {}), ("zero3", ZERO3)):
        engine = build("darts", strategy, options, engine_class=Validated, train_iters=50,
                       valid_step=2, early_stopping=EarlyStopping("loss", patience=2))
        assert isinstance(engine, Validated)
        engine.run()
        live = final(engine)  # collective, on every rank
        same = all(torch.equal(live[f"inner.{n}"], t) for n, t in
                   getattr(engine, "replica", {}).items())
        out.append((engine.global_step, engine.stopped_early, engine.last_validation,
                    getattr(engine, "calls", 0), same))
    broken = build("darts", "ddp", engine_class=Validated, valid_step=2)
    broken.fail = True  # type: ignore[attr-defined]
    try:
        broken.run()
        out.append("no error")
    except RuntimeError as err:
        out.append(str(err))
    return out


def test_validation_on_rank_zero_and_collective_early_stopping() -> None:
    results = run_on_ranks(_validate_and_stop, 2)
    for rank, (*runs, broken) in enumerate(results):
        for step, stopped, metrics, calls, same in runs:
            # best at the 1st validation, no improvement at the 2nd and 3rd: stop at it. 6
            assert (step, stopped) == (6, True), f"rank {rank}"
            assert metrics["loss"] == 1.0 and metrics["mse"] > 0  # broadcast to every rank
            assert calls == (3 if rank == 0 else 0)  # validation() ran on rank 0 only
            assert same  # the replica held the trained weights
        assert "validation() failed on rank 0" in broken and "broken metric" in broken, broken


# ----- single-process features --------------------------------------------------------------
def test_loggers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build("darts", logger_type="csv", log_dir=str(tmp_path), log_step=5).run()
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,tag,metric,value"
    assert {r.rsplit(",", 1)[0] for r in rows[1:]} == {
        "5,train,inner/loss", "5,train,hyper/loss", "10,train,inner/loss", "10,train,hyper/loss"}
    build("darts", logger_type="stdout", log_step=10).run()
    assert "[iteration 10] train: inner/loss=" in capsys.readouterr().out
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorboard, or choose one of: "
                                              "none, stdout, csv"):
            build("darts", logger_type="tensorboard", log_dir=str(tmp_path))
    with pytest.raises(ValueError, match="choose one of: none, stdout, tensorboard, csv"):
        EngineConfig(logger_type="wandb")


def _resume(path: str) -> bool:
    whole = build("neumann", "zero3", ZERO3, train_iters=8)
    whole.run()
    build("neumann", "zero3", ZERO3, train_iters=4, checkpoint_step=4,
          checkpoint_dir=path).run()
    resumed = build("neumann", "zero3", ZERO3, train_iters=8, resume_from=path)
    resumed.run()
    want, got = final(whole), final(resumed)
    return all(torch.allclose(got[k], want[k], rtol=TOL["rtol"], atol=TOL["atol"])
               for k in want)


def test_resume_from_checkpoint_under_zero3_on_two_ranks(tmp_path: Path) -> None:
    """Save at iteration 4, resume in a new engine: the same as 8 iterations straight."""
    assert run_on_ranks(_resume, 2, args=(str(tmp_path / "ck"),)) == [True, True]


def test_first_order_gives_the_direct_gradient_only() -> None:
    engine = build("darts", train_iters=1, first_order=True)
    lam = math.log(0.3)
    g = 0.02 * lam  # d/dlam of 0.01 lam^2: the only term left without the response
    want = torch.full((D,), lam - OUTER_LR * g / (abs(g) + 1e-8), dtype=torch.float64)
    engine.run()  # Adam's first step: lr * g / (|g| + eps)
    torch.testing.assert_close(engine.problems["hyper"].params()["log_decay"], want)


def test_per_problem_precision_loss_scaler_and_scheduler() -> None:
    """A 16-mixed upper level: its own strategy owns a loss scaler, the hypergradient is
    taken of the scaled loss and unscaled by the optimizer's hook (no step skipped, same
    result up to the float32 outputs of mixed precision). A scheduler built before setup
    keeps driving the user's optimizer object."""
    plain, mixed = build("cg"), build("cg", upper_precision="16-mixed")
    plain.run()
    mixed.run()
    hyper = mixed.problems["hyper"]
    assert hyper.strategy is not None and hyper.strategy.config.precision == "16-mixed"
    scaler = hyper.strategy.scaler
    assert scaler is not None and scaler.skipped_steps == 0 and scaler.growth_tracker == 10
    _close(final(mixed), final(plain), "16-mixed upper level", FLOAT32)
    scheduled = build("cg", schedule=True)
    opt = scheduled.problems["inner"].optimizer
    scheduled.run()
    assert scheduled.problems["inner"].optimizer is opt
    assert opt.param_groups[0]["lr"] == INNER_LR / 2


class Level(Problem):
    def training_step(self, batch: Any) -> Tensor:
        return sum(p.sum() for p in self.parameters_dict().values()) ** 2  # type: ignore[return-value]


def test_schedule_of_a_three_level_problem() -> None:
    def level(name: str, **config: Any) -> Level:
        module = nn.Linear(2, 1)
        return Level(name, module, torch.optim.SGD(module.parameters(), lr=0.01),
                     config=ProblemConfig(**config))

    low, mid, top = level("low", unroll_steps=2), level("mid", unroll_steps=3), level("top")
    engine = Engine([low, mid, top], EngineConfig(train_iters=12),
                    {"u2l": {"mid": ["low"], "top": ["mid"]}, "l2u": {low: mid, mid: top}})
    assert engine.leaves == [low] and engine.mid is mid
    engine.run()
    assert (low.steps, mid.steps, top.steps) == (12, 6, 2)


def test_configuration_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError,
                       match="choose one of: unrolled, darts, neumann, cg, sama, reinforce"):
        ProblemConfig(method="magic")
    with pytest.raises(TypeError, match="takes a NeumannConfig"):
        ProblemConfig(method="neumann", hypergrad=CGConfig())
    with pytest.raises(ValueError, match="strategy 'zer2' is not known; choose one of: single"):
        EngineConfig(strategy="zer2")
    with pytest.raises(ValueError, match="choose one of: min, max"):
        EarlyStopping(mode="lowest")
    def level(name: str) -> Level:
        module = nn.Linear(2, 1)
        return Level(name, module, torch.optim.SGD(module.parameters(), lr=0.1))

    with pytest.raises(ValueError, match="cannot be used"):
        level("optimizer")
    a, b = level("a"), level("b")
    with pytest.raises(ValueError, match="not one of this engine's problems: a, b"):
        Engine([a, b], dependencies={"u2l": {"a": ["c"]}})
    with pytest.raises(ValueError, match="cycle"):
        Engine([a, b], dependencies={"l2u": {"a": ["b"], "b": ["a"]}})
    with pytest.raises(ValueError, match="unknown key"):
        Engine([a, b], dependencies={"upper_to_lower": {}})


# ----- the examples -----------------------------------------------------------------------------
def _run_example(name: str, argv: list[str]) -> dict[str, float]:
    result: dict[str, float] = runpy.run_path(str(ROOT / "examples" / name))["main"](argv)
    return result


def test_examples_run_on_two_ranks(tmp_path: Path) -> None:
    runs = {"maml_engine.py": ["--iters", "4", "--valid-step", "2", "--meta-batch", "4",
                               "--plot", str(tmp_path / "maml.png")],
            "meta_weight_net.py": ["--iters", "20", "--valid-step", "10",
                                   "--plot", str(tmp_path / "mwn.png")]}
    for name, argv in runs.items():
        for rank, result in enumerate(run_on_ranks(_run_example, 2, args=(name, argv))):
            assert result and all(math.isfinite(v) for v in result.values()), (name, rank)
    assert (tmp_path / "maml.png").stat().st_size > 1000
    assert (tmp_path / "mwn.png").stat().st_size > 1000
