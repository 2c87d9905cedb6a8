"""Meta-learning throughput: MAML weak scaling, and a bilevel step against Betty 0.2.1.

    python -m benchmarks.meta [--steps 20] [--warmup 3] [--parts maml,betty]
                              [--device auto|cpu|cuda] [--json PATH] [--quick]

MAML: second-order MAML (5 inner steps, 4 tasks per rank, 40-40 tanh MLP) at world sizes 1
and 2 with the same tasks per rank (weak scaling), three ways taking turns in the same
processes: through the Engine, as a hand-written loop on the strategy API, and the
no-communication bound (plain torch, nothing synchronised). On cuda: world sizes 1 and the
number of GPUs (NCCL, one GPU per rank).

Betty: a Meta-Weight-Net style bilevel problem (a 64-128-10 classifier on noisy labels, a
1-32-1 loss-to-weight net trained on a meta set), one lower step + one hypergradient step
per iteration, metadist's Engine and Betty's Engine alternating in the same processes. Method
pairs compute the same mathematics: Betty's "darts" is gF - M.v by a finite difference, which
is metadist's neumann with 0 iterations and alpha 1 (by an exact double backward), except that
perturbing the parameters also moves the ``losses.detach()`` the weight net reads, which the
analytic product treats as constant (so that row differs by ~1e-3; with a weight-net input
that does not depend on the classifier the two agree to ~1e-6); Betty's neumann and cg
(1 iteration; from 2 on, Betty's CG updates its direction with the old residual) are
metadist's. Results are compared in float64 after 10
iterations: single process against single process, and each library's 2-rank run against its
own single-process run (Betty averages only the last piece of the hypergradient). The
collectives column counts metadist's per iteration: one per synced product (exactness), where
Betty issues two (the lower level's DDP all-reduce and the last piece's).
Betty is installed beside the package, never into it:
    .venv/bin/python -m pip install -q --target .bench --no-deps --ignore-requires-python \\
        betty-ml==0.2.1
Its distributed mode assumes CUDA and owns the process group; the harness's shims (CPU
device, adopt metadist's gloo group, no destroy at the end) live in :func:`_betty_engine`;
so this part runs on the CPU whatever ``--device`` says.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from benchmarks import device
from benchmarks.common import Results, alternate, output_args, parse, use_peers
from metadist.comm import stats
from metadist.meta import CGConfig, Engine, EngineConfig, NeumannConfig, Problem, ProblemConfig

TASKS, INNER_STEPS, INNER_LR = 4, 5, 0.01


# ----- MAML -----------------------------------------------------------------------------------
def _tasks(seed: int, count: int = TASKS) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        amp, phase = 0.1 + 4.9 * torch.rand(1, generator=g), math.pi * torch.rand(1, generator=g)
        x = torch.rand(20, 1, generator=g) * 10 - 5
        y = amp * torch.sin(x + phase)
        out.append((x[:10], y[:10], x[10:], y[10:]))
    return out


def _sine_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                         nn.Linear(40, 1))


def maml_loss(forward: Callable[[dict[str, Tensor], Tensor], Tensor],
               params: dict[str, Tensor], tasks: list[tuple[Tensor, ...]]) -> Tensor:
    total = torch.zeros((), device=tasks[0][0].device)
    for xs, ys, xq, yq in tasks:
        fast = params
        for _ in range(INNER_STEPS):
            loss = nn.functional.mse_loss(forward(fast, xs), ys)
            grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
            fast = {n: p - INNER_LR * g for (n, p), g in zip(fast.items(), grads, strict=True)}
        total = total + nn.functional.mse_loss(forward(fast, xq), yq)
    return total / len(tasks)


class _TaskList(torch.utils.data.Dataset[tuple[Tensor, ...]]):
    def __init__(self, tasks: list[tuple[Tensor, ...]]) -> None:
        self.tasks = tasks

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:
        return self.tasks[i]


class _MAML(Problem):
    def training_step(self, batch: Any) -> Tensor:
        dev = device.here()
        tasks = [tuple(t.to(dev) for t in task) for task in zip(*batch, strict=True)]
        return maml_loss(self.functional_forward, self.parameters_dict(), tasks)


def _maml_body(steps: int, warmup: int) -> dict[str, float]:
    w = metadist.world()
    name = "single" if w.world_size == 1 else "ddp"
    # the same number of tasks per rank at every world size
    mine = [tuple(t.to(w.device) for t in task) for task in _tasks(w.rank)]

    plain = _sine_net().to(w.device)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)

    def bound() -> None:
        plain_opt.zero_grad()
        maml_loss(lambda p, x: torch.func.functional_call(plain, p, (x,)),
                   dict(plain.named_parameters()), mine).backward()
        plain_opt.step()

    strategy = metadist.strategy(name)
    net = _sine_net()
    model, opt = strategy.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))

    def loop() -> None:
        opt.zero_grad()
        strategy.backward(maml_loss(model.functional_forward, model.full_parameters(), mine))
        opt.step()

    everyone = [t for r in range(w.world_size) for t in _tasks(r)]  # rank r reads slice r
    net = _sine_net()
    learner = _MAML("maml", net, torch.optim.Adam(net.parameters(), lr=1e-3),
                    train_data_loader=DataLoader(_TaskList(everyone), batch_size=TASKS))
    engine = Engine([learner], EngineConfig(strategy=name, logger_type="none"))
    return alternate({"no-comm bound": bound, "strategy loop": loop,
                      "Engine": engine.train_step}, steps, warmup)


# ----- bilevel against Betty ----------------------------------------------------------------
N_TRAIN, N_META, BATCH, META_BATCH = 1024, 256, 64, 32  # batches are global


class _Rows(TensorDataset):
    """Fetches a whole batch with one indexing op (``__getitems__``), so that per-sample
    Python in the data loader, identical for both libraries, does not dominate the step."""

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, ...]:
        return tuple(t[indices] for t in self.tensors)


def _as_is(batch: Any) -> Any:
    return batch


def _loader(rows: _Rows, batch_size: int) -> DataLoader[Any]:
    return DataLoader(rows, batch_size=batch_size, collate_fn=_as_is)


def _bilevel_data(dtype: torch.dtype) -> tuple[_Rows, _Rows]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_META, 64, generator=g, dtype=dtype)
    y = (x[:, :10].argmax(1) + (torch.rand(N_TRAIN + N_META, generator=g) < 0.4)
         * torch.randint(1, 10, (N_TRAIN + N_META,), generator=g)) % 10
    y[N_TRAIN:] = x[N_TRAIN:, :10].argmax(1)  # the meta set is clean
    return _Rows(x[:N_TRAIN], y[:N_TRAIN]), _Rows(x[N_TRAIN:], y[N_TRAIN:])


def _bilevel_modules(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(1)
    return (nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(dtype),
            nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid()).to(dtype))


def _inner_loss(problem: Any, batch: Any) -> Tensor:
    x, y = batch
    losses = nn.functional.cross_entropy(problem(x), y, reduction="none")
    return (problem.outer(losses.detach().unsqueeze(1)).squeeze(1) * losses).mean()


def _outer_loss(problem: Any, batch: Any) -> Tensor:
    x, y = batch
    return nn.functional.cross_entropy(problem.inner(x), y)


class _Inner(Problem):
    def training_step(self, batch: Any) -> Tensor:
        return _inner_loss(self, batch)


class _Outer(Problem):
    def training_step(self, batch: Any) -> Tensor:
        return _outer_loss(self, batch)


# (label, metadist method config, Betty Config kwargs): the same mathematics each
PAIRS: list[tuple[str, ProblemConfig, dict[str, Any]]] = [
    ("gF - M.v (Betty darts)", ProblemConfig(method="neumann", hypergrad=NeumannConfig(
        iterations=0, alpha=1.0)), {"type": "darts"}),
    ("neumann 3 iterations", ProblemConfig(method="neumann", hypergrad=NeumannConfig(
        iterations=3, alpha=0.1)), {"type": "neumann", "neumann_iterations": 3,
                                    "neumann_alpha": 0.1}),
    ("cg 1 iteration", ProblemConfig(method="cg", hypergrad=CGConfig(iterations=1, tol=0.0)),
     {"type": "cg", "cg_iterations": 1, "cg_alpha": 1.0}),
]


def _metadist_engine(pair: int, dtype: torch.dtype) -> Engine:
    n = metadist.world().world_size
    train, meta = _bilevel_data(dtype)
    clf, wnet = _bilevel_modules(dtype)
    inner = _Inner("inner", clf, torch.optim.SGD(clf.parameters(), lr=0.1),
                   train_data_loader=_loader(train, BATCH // n),
                   config=PAIRS[pair][1])
    outer = _Outer("outer", wnet, torch.optim.Adam(wnet.parameters(), lr=1e-3),
                   train_data_loader=_loader(meta, META_BATCH // n))
    return Engine([inner, outer], EngineConfig(strategy="single" if n == 1 else "ddp"),
                  {"u2l": {outer: [inner]}, "l2u": {inner: [outer]}})


def _betty_engine(pair: int, dtype: torch.dtype) -> Any:
    """Betty's Engine on the same problem. Shims (harness only): Betty's distributed mode
    calls torch.cuda.set_device and rank % cuda.device_count() (a ZeroDivisionError on a CPU
    machine) and initialises the process group itself, then destroys it in cleanup(); here
    it adopts metadist's gloo group on the CPU and leaves it alone."""
    from betty.configs import Config
    from betty.configs import EngineConfig as BettyEngineConfig
    from betty.engine import Engine as BettyEngine
    from betty.problems import ImplicitProblem

    class CpuEngine(BettyEngine):  # type: ignore[misc]
        def configure_systems(self) -> dict[str, Any]:
            distributed = self._strategy == "distributed"
            self._world_size = dist.get_world_size() if distributed else 0
            self._rank = dist.get_rank() if distributed else 0
            self._local_rank = self._rank
            self.device = torch.device("cpu")
            return {"strategy": self._strategy, "backend": "gloo", "world_size": self._world_size,
                    "rank": self._rank, "local_rank": self._local_rank}

        def cleanup(self) -> None:
            pass

    class Inner(ImplicitProblem):  # type: ignore[misc]
        def training_step(self, batch: Any) -> Tensor:
            return _inner_loss(self, batch)

    class Outer(ImplicitProblem):  # type: ignore[misc]
        def training_step(self, batch: Any) -> Tensor:
            return _outer_loss(self, batch)

    n = metadist.world().world_size
    train, meta = _bilevel_data(dtype)
    clf, wnet = _bilevel_modules(dtype)
    # Betty deals whole batches round-robin to ranks: per-rank batch B/N, so the global
    # batch of a step is the same contiguous samples as one process's batch B.
    inner = Inner(name="inner", module=clf, optimizer=torch.optim.SGD(clf.parameters(), lr=0.1),
                  train_data_loader=_loader(train, BATCH // n),
                  config=Config(**PAIRS[pair][2]))
    outer = Outer(name="outer", module=wnet,
                  optimizer=torch.optim.Adam(wnet.parameters(), lr=1e-3),
                  train_data_loader=_loader(meta, META_BATCH // n),
                  config=Config(retain_graph=True))  # its backward reuses the outer graph
    config = BettyEngineConfig(train_iters=10**9, valid_step=10**9,
                               strategy="distributed" if n > 1 else "default")
    engine = CpuEngine(config=config, problems=[outer, inner],
                       dependencies={"u2l": {outer: [inner]}, "l2u": {inner: [outer]}})

    def step() -> None:
        engine.global_step += 1
        engine.train_step()

    engine.step = step
    return engine


def _betty_params(engine: Any) -> dict[str, Tensor]:
    out = {}
    for p in (engine.inner, engine.outer):
        module = getattr(p.module, "module", p.module)  # DDP-wrapped in distributed mode
        out.update({f"{p.name}.{n}": t.detach().clone() for n, t in module.named_parameters()})
    return out


def _ours_params(engine: Engine) -> dict[str, Tensor]:
    return {f"{p.name}.{n}": t.clone() for p in engine.problems.values()
            for n, t in p.params().items()}


def _betty_body(steps: int, warmup: int) -> dict[str, Any]:
    from betty.logging.logger_base import get_logger

    get_logger().setLevel(logging.WARNING)  # Betty logs every problem at INFO on stdout
    out: dict[str, Any] = {}
    for i, (label, _, _) in enumerate(PAIRS):
        ours, betty = _metadist_engine(i, torch.float32), _betty_engine(i, torch.float32)
        out[f"time {label}"] = alternate({"metadist": ours.train_step, "Betty": betty.step},
                                         steps, warmup)
        with stats.counting() as counted:  # the price of exactness: one per synced product
            ours.train_step()
        out[f"collectives {label}"] = counted.calls
        ours, betty = _metadist_engine(i, torch.float64), _betty_engine(i, torch.float64)
        for _ in range(10):
            ours.train_step()
            betty.step()
        out[f"params {label}"] = (_ours_params(ours), _betty_params(betty))
    return out


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _maml(out: Results, steps: int, warmup: int, worlds: tuple[int, ...]) -> None:
    res = {n: metadist.launch(_maml_body, n, args=(steps, warmup), threads=1,
                              timeout=3000)[0] for n in worlds}
    out.heading(f"second-order MAML, {TASKS} tasks per rank x {INNER_STEPS} inner steps, "
                f"{device.where(worlds[-1])} (medians of {steps}, alternating)")
    rows, records = [], []
    for n in worlds:
        for kind, seconds in res[n].items():
            rows.append((n, kind, seconds * 1e3, 1 / seconds, n * TASKS / seconds,
                         f"{res[1][kind] / seconds:.2f}"))
            records.append({"ranks": n, "configuration": kind, "ms": seconds * 1e3,
                            "tasks_per_s": n * TASKS / seconds,
                            "weak_scaling_efficiency": res[1][kind] / seconds})
    out.table(["ranks", "configuration", "ms / meta-step", "meta-steps / s", "tasks / s",
               "weak-scaling efficiency (t1 / tN)"], rows, key="maml")
    out.data["maml"] = records


def _betty(out: Results, steps: int, warmup: int) -> None:
    res = {n: metadist.launch(_betty_body, n, args=(steps, warmup), threads=1,
                              timeout=3000)[0] for n in (1, 2)}
    out.heading(f"bilevel step (lower SGD step + hypergradient step) vs Betty 0.2.1, "
                f"gloo, 1 thread per rank (medians of {steps}, alternating)")
    rows, records = [], []
    for label, _, _ in PAIRS:
        o1, b1 = res[1][f"params {label}"]
        o2, b2 = res[2][f"params {label}"]
        for n in (1, 2):
            t = res[n][f"time {label}"]
            rows.append((label, n, t["metadist"] * 1e3, t["Betty"] * 1e3,
                         f"{t['Betty'] / t['metadist']:.2f}",
                         res[n][f"collectives {label}"] if n > 1 else "-",
                         f"{_max_diff(o1, b1):.1e}" if n == 1 else "-",
                         f"{_max_diff(o2, o1):.1e}" if n == 2 else "-",
                         f"{_max_diff(b2, b1):.1e}" if n == 2 else "-"))
            records.append({
                "hypergradient": label, "ranks": n, "metadist_ms": t["metadist"] * 1e3,
                "betty_ms": t["Betty"] * 1e3, "speedup": t["Betty"] / t["metadist"],
                "metadist_collectives": res[n][f"collectives {label}"],
                "max_diff_vs_betty": _max_diff(o1, b1) if n == 1 else None,
                "metadist_2_vs_1": _max_diff(o2, o1) if n == 2 else None,
                "betty_2_vs_1": _max_diff(b2, b1) if n == 2 else None})
    out.table(["hypergradient", "ranks", "metadist ms / it", "Betty ms / it",
               "speed-up", "metadist collectives / it", "max |metadist - Betty| (1 rank)",
               "max |metadist 2 - 1 ranks|", "max |Betty 2 - 1 ranks|"], rows, key="betty")
    out.note("(parameters after 10 iterations in float64, same init and data order)")
    out.data["betty"] = records


def main() -> None:
    peers = use_peers()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="steps discarded first")
    ap.add_argument("--parts", default="maml,betty", help="comma-separated: maml, betty")
    device.add_args(ap, world=False)
    output_args(ap)
    args = parse(ap, steps=2, warmup=1)
    gpus = torch.cuda.device_count() if device.resolve(args) == "cuda" else 2
    with Results("meta", args) as out:  # JSON also of what ran before a failure
        parts = args.parts.split(",")
        if "maml" in parts:
            _maml(out, args.steps, args.warmup, tuple(dict.fromkeys((1, gpus))))
        if "betty" in parts:
            try:
                import betty  # noqa: F401
            except ImportError as err:
                where = "not in .bench/" if peers else ".bench/ does not exist"
                out.skip("bilevel step vs Betty 0.2.1", f"Betty is not importable ({err}; {where}; "
                         "`make bench` installs it there, see the docstring)")
            else:
                with device.cpu_ranks():
                    _betty(out, args.steps, args.warmup)


if __name__ == "__main__":
    main()
