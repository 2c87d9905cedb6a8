"""The Betty drop-in: the same Betty programs on Betty 0.2.1 and on metadist.compat.betty.

    python -m benchmarks.betty_compat [--steps 20] [--warmup 3] [--json PATH] [--quick]

Each program below is written once, against Betty's API (``engine``, ``configs``,
``problems`` passed in as modules), so the same text runs on Betty and on the drop-in whose
only difference is the import (``from betty.X`` -> ``from metadist.compat.betty.X``):

* reweighting, darts: Meta-Weight-Net (a 64-128-10 classifier on 40%-noisy labels, SGD with
  momentum; a 1-32-1 sigmoid loss-to-weight net trained by Adam on a clean meta set), inner
  ``Config(type="darts", unroll_steps=1)``, outer ``Config(retain_graph=True)``;
* logistic-regression HPO (Betty's examples/logistic_regression_hpo and test_install.py): a
  per-feature L2 decay as the upper parameter (SGD, momentum 0.9, clamped positive by
  ``param_callback``), the inner weights zeroed by ``on_inner_loop_start``, inner
  ``Config(type="cg", cg_iterations=3, cg_alpha=0.1, unroll_steps=10)``;
* reweighting, neumann: the first with ``type="neumann", neumann_iterations=3,
  neumann_alpha=0.1``.

One process (gloo world of 1, 1 thread): the two engines take turns, ``global_step += 1;
train_step()`` each (as Betty's ``run`` does), warm-up discarded, medians; for the HPO program
a sample is one unroll window (10 iterations, one hypergradient) and is reported per
iteration. Then each pair runs from identical initial weights in float64 (10 iterations, the
HPO program 20: two windows) and the final parameters are compared. Last, the reweighting
program under ``EngineConfig(strategy="distributed")`` on 2 ranks with half the batch per
rank (Betty's meaning of a DataLoader's batch_size), against the drop-in's one process.
Betty runs in one process only (its distributed mode needs CUDA; see benchmarks/meta.py).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import metadist
from benchmarks.common import Results, alternate, output_args, parse, use_peers
from benchmarks.meta import BATCH, META_BATCH, _bilevel_data, _bilevel_modules, _loader, _Rows
from metadist.comm import stats

LR_DATA, LR_DIM, UNROLL = 1000, 20, 10  # Betty's HPO example: 500 train + 500 val, full batch
CHECK_ITERS = {"reweighting": 10, "hpo": 2 * UNROLL}


class Api(NamedTuple):
    """What a Betty program imports: ``betty.engine``, ``betty.configs``, ``betty.problems``."""

    engine: Any
    configs: Any
    problems: Any


# ----- the programs: Betty's API only -------------------------------------------------------
def reweighting(betty: Api, inner_config: dict[str, Any], dtype: torch.dtype,
                strategy: str = "default", ranks: int = 1) -> tuple[Any, list[Any]]:
    """Meta-Weight-Net; batch sizes per rank, so every world size reads the same batches."""
    configs = betty.configs
    base: Any = betty.problems.ImplicitProblem

    class Classifier(base):  # type: ignore[misc]
        def training_step(self, batch: Any) -> Tensor:
            x, y = batch
            losses = F.cross_entropy(self.module(x), y, reduction="none")
            weights: Tensor = self.outer(losses.detach().unsqueeze(1)).squeeze(1)
            return (weights * losses).mean()

    class Reweighter(base):  # type: ignore[misc]
        def training_step(self, batch: Any) -> Tensor:
            x, y = batch
            logits: Tensor = self.inner(x)
            return F.cross_entropy(logits, y)

    train, meta = _bilevel_data(dtype)
    clf, wnet = _bilevel_modules(dtype)
    inner = Classifier(name="inner", module=clf, config=configs.Config(**inner_config),
                       optimizer=torch.optim.SGD(clf.parameters(), lr=0.1, momentum=0.9),
                       train_data_loader=_loader(train, BATCH // ranks))
    outer = Reweighter(name="outer", module=wnet, config=configs.Config(retain_graph=True),
                       optimizer=torch.optim.Adam(wnet.parameters(), lr=1e-3),
                       train_data_loader=_loader(meta, META_BATCH // ranks))
    engine = betty.engine.Engine(
        config=configs.EngineConfig(train_iters=10**9, valid_step=10**9, strategy=strategy),
        problems=[outer, inner],
        dependencies={"u2l": {outer: [inner]}, "l2u": {inner: [outer]}})
    return engine, [inner, outer]


class _Decay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(LR_DIM))

    def forward(self) -> Tensor:
        return self.w


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(LR_DIM))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x @ self.w, self.w


def hpo(betty: Api, dtype: torch.dtype, strategy: str = "default",
        ranks: int = 1) -> tuple[Any, list[Any]]:
    """Per-feature L2 decay for logistic regression (Betty's HPO example, cg 3 iterations)."""
    configs = betty.configs
    base: Any = betty.problems.ImplicitProblem

    class Parent(base):  # type: ignore[misc]
        def training_step(self, batch: Any) -> Tensor:
            x, y = batch
            logits: Tensor = self.inner(x)[0]
            return F.binary_cross_entropy_with_logits(logits, y)

        def param_callback(self) -> None:
            for p in self.trainable_parameters():
                p.data.clamp_(min=1e-8)

    class Child(base):  # type: ignore[misc]
        def training_step(self, batch: Any) -> Tensor:
            x, y = batch
            outs, w = self.module(x)
            decay: Tensor = (w.unsqueeze(0) @ torch.diag(self.outer()) @ w.unsqueeze(1)).sum()
            return F.binary_cross_entropy_with_logits(outs, y) + 0.5 * decay

        def on_inner_loop_start(self) -> None:
            self.module.w.data.zero_()

    g = torch.Generator().manual_seed(0)
    w_gt = torch.randn(LR_DIM, generator=g, dtype=dtype)
    x = torch.randn(LR_DATA, LR_DIM, generator=g, dtype=dtype)
    y = (x @ w_gt + 0.1 * torch.randn(LR_DATA, generator=g, dtype=dtype) > 0).to(dtype)
    half = LR_DATA // 2
    train, val = _Rows(x[:half], y[:half]), _Rows(x[half:], y[half:])
    child_net, parent_net = _Linear().to(dtype), _Decay().to(dtype)
    child = Child(name="inner", module=child_net,
                  config=configs.Config(type="cg", cg_iterations=3, cg_alpha=0.1,
                                        unroll_steps=UNROLL),
                  optimizer=torch.optim.SGD(child_net.parameters(), lr=0.1),
                  train_data_loader=_loader(train, half // ranks))
    parent = Parent(name="outer", module=parent_net,
                    config=configs.Config(first_order=True, retain_graph=True),
                    optimizer=torch.optim.SGD(parent_net.parameters(), lr=1, momentum=0.9),
                    train_data_loader=_loader(val, half // ranks))
    engine = betty.engine.Engine(
        config=configs.EngineConfig(train_iters=10**9, valid_step=10**9, strategy=strategy),
        problems=[parent, child],
        dependencies={"u2l": {parent: [child]}, "l2u": {child: [parent]}})
    return engine, [child, parent]


# (label, hypergradient, builder, timed iterations per sample)
Builder = Callable[[Api, torch.dtype], tuple[Any, list[Any]]]
PROGRAMS: list[tuple[str, str, Builder, int]] = [
    ("reweighting", "darts", lambda b, d: reweighting(b, {"type": "darts"}, d), 1),
    ("hpo", "cg, 3 iterations, unroll 10", hpo, UNROLL),
    ("reweighting", "neumann, 3 iterations",
     lambda b, d: reweighting(b, {"type": "neumann", "neumann_iterations": 3,
                                  "neumann_alpha": 0.1}, d), 1),
]


# ----- harness --------------------------------------------------------------------------------
def _compat() -> Api:
    from metadist.compat.betty import configs, engine, problems
    from metadist.compat.betty import logging as blog

    blog.get_logger().setLevel(logging.WARNING)
    return Api(engine, configs, problems)


def _betty() -> Api:
    """Betty's modules; its Engine pinned to the CPU metadist runs on here (Betty's default
    strategy would pick CUDA when present)."""
    from betty import configs, engine, problems
    from betty.logging.logger_base import get_logger

    get_logger().setLevel(logging.WARNING)  # Betty logs every problem at INFO on stdout

    class CpuEngine(engine.Engine):  # type: ignore[misc]
        def configure_systems(self) -> dict[str, Any]:
            out: dict[str, Any] = super().configure_systems()
            self.device = torch.device("cpu")
            return out

    return Api(SimpleNamespace(Engine=CpuEngine), configs, problems)


def _stepper(engine: Any) -> Callable[[], object]:
    def step() -> None:  # Betty's run(): global_step first, then the leaves
        engine.global_step += 1
        engine.train_step()
    return step


def _params(problems: list[Any]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for p in problems:
        if callable(getattr(p, "params", None)):  # the drop-in: full parameters by name
            named = p.params(clone=True).items()
        else:  # Betty: the module (DDP-wrapped in its distributed mode)
            named = getattr(p.module, "module", p.module).named_parameters()
        out.update({f"{p.name}.{n}": t.detach().clone() for n, t in named})
    return out


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _one_process(steps: int, warmup: int, with_betty: bool) -> list[dict[str, Any]]:
    """Per program: medians (compat, Betty) and the float64 parameters of both."""
    apis = {"compat": _compat(), **({"Betty": _betty()} if with_betty else {})}
    out = []
    for name, _, build, inner in PROGRAMS:
        steppers = {k: _stepper(build(api, torch.float32)[0]) for k, api in apis.items()}
        seconds = alternate(steppers, steps, warmup, inner=inner)
        params = {}
        for k, api in apis.items():
            engine, problems = build(api, torch.float64)
            step = _stepper(engine)
            for _ in range(CHECK_ITERS[name]):
                step()
            params[k] = _params(problems)
        out.append({"seconds": seconds, "params": params})
    return out


def _two_ranks(steps: int, warmup: int) -> dict[str, Any]:
    """The reweighting program (darts) on the drop-in, strategy "distributed", 2 ranks."""
    api = _compat()
    ranks = metadist.world().world_size
    engine, _ = reweighting(api, {"type": "darts"}, torch.float32, "distributed", ranks)
    step = _stepper(engine)
    seconds = alternate({"compat": step}, steps, warmup)["compat"]
    with stats.counting() as counted:
        step()
    engine, problems = reweighting(api, {"type": "darts"}, torch.float64, "distributed", ranks)
    step = _stepper(engine)
    for _ in range(CHECK_ITERS["reweighting"]):
        step()
    return {"seconds": seconds, "params": _params(problems), "ranks": ranks,
            "collectives": counted.calls}


def _report(out: Results, one: list[dict[str, Any]], two: dict[str, Any] | None,
            steps: int, with_betty: bool) -> None:
    out.heading(f"the same Betty program on metadist.compat.betty and Betty 0.2.1, one "
                f"process, gloo, 1 thread (medians of {steps}, alternating)")
    rows: list[tuple[object, ...]] = []
    records = []
    for (name, method, _, inner), res in zip(PROGRAMS, one, strict=True):
        t, p = res["seconds"], res["params"]
        betty_ms = t["Betty"] * 1e3 if with_betty else None
        ratio = t["Betty"] / t["compat"] if with_betty else None
        diff = _max_diff(p["compat"], p["Betty"]) if with_betty else None
        rows.append((name, method, t["compat"] * 1e3, betty_ms,
                     "-" if ratio is None else f"{ratio:.2f}",
                     "-" if diff is None else f"{diff:.1e}", CHECK_ITERS[name]))
        records.append({"program": name, "hypergradient": method,
                        "compat_ms_per_it": t["compat"] * 1e3, "betty_ms_per_it": betty_ms,
                        "betty_over_compat": ratio, "max_diff_vs_betty": diff,
                        "check_iterations": CHECK_ITERS[name], "iterations_per_sample": inner})
    out.table(["program", "hypergradient (inner Config)", "compat ms / it", "Betty ms / it",
               "Betty / compat", "max |compat - Betty| (float64)", "iterations compared"],
              rows, key="one_process")
    out.data["one_process"] = records
    if two is None:
        return
    one_ms, n = one[0]["seconds"]["compat"] * 1e3, two["ranks"]
    two_ms = two["seconds"] * 1e3
    diff = _max_diff(two["params"], one[0]["params"]["compat"])
    out.heading(f"reweighting (darts) on metadist.compat.betty, EngineConfig(strategy="
                f"\"distributed\"), gloo, 1 thread per rank (medians of {steps})")
    rows = [(1, '"default"', BATCH, BATCH, one_ms, 1e3 / one_ms, BATCH * 1e3 / one_ms, 0, "-"),
            (n, '"distributed"', BATCH // n, BATCH, two_ms, 1e3 / two_ms,
             BATCH * 1e3 / two_ms, two["collectives"], f"{diff:.1e}")]
    out.table(["ranks", "strategy", "per-rank batch", "global batch", "ms / it", "it / s",
               "samples / s", "collectives / it", "max |N ranks - 1 process| (float64)"], rows,
              key="two_ranks")
    out.data["two_ranks"] = {"ranks": n, "per_rank_batch": BATCH // n, "ms_per_it": two_ms,
                             "it_per_s": 1e3 / two_ms, "one_process_ms_per_it": one_ms,
                             "collectives_per_it": two["collectives"],
                             "max_diff_vs_one_process": diff}


def main() -> None:
    peers = use_peers()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed samples per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="samples discarded first")
    ap.add_argument("--ranks", type=int, default=2, help="world size of the multi-rank part "
                    "(0: skip it)")
    output_args(ap)
    args = parse(ap, steps=2, warmup=1)
    with Results("betty_compat", args) as out:  # JSON also of what ran before a failure
        try:
            betty: ModuleType | None = __import__("betty")
        except ImportError as err:
            betty = None
            where = "not in .bench/" if peers else ".bench/ does not exist"
            out.skip("Betty 0.2.1 columns", f"Betty is not importable ({err}; {where}; `make "
                     "bench` installs it there, see benchmarks/meta.py)")
        with_betty = betty is not None
        one = metadist.launch(_one_process, 1, args=(args.steps, args.warmup, with_betty),
                              threads=1, timeout=3000)[0]
        two = (metadist.launch(_two_ranks, args.ranks, args=(args.steps, args.warmup),
                               threads=1, timeout=3000)[0] if args.ranks > 1 else None)
        _report(out, one, two, args.steps, with_betty)
        out.note("(parameters of both levels compared after the iterations shown, float64, "
                 "same initial weights and data order; HPO times are per iteration, measured "
                 f"over whole {UNROLL}-iteration unroll windows)")


if __name__ == "__main__":
    main()
