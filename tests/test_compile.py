"""torch.compile under every strategy, both ways it is written: the user's module compiled
before setup (``torch.compile(net)``, ``net.compile()``) and the set-up model compiled after
(``torch.compile(model)``, ``model.compile()``).

Each form trains 10 steps on 2 ranks (one zero3 case on 3) and must match one process
compiled with the same backend on the same global batches (fp32, tests/parity.py's
tolerances), with no graph break, no compile after the first step, and every step of every
piece running compiled, forward and backward (a counting aot_eager backend). Inductor on CPU
runs the representative cases (ddp and zero3, before and after setup): before, it failed
lowering the flat buffers' storage resizes that Dynamo traced from zero3's hooks.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

STEPS = 10
GLOBAL_BATCH = 12  # divisible by 1, 2 and 3
FORMS = ("compile_before", "module_compile_before", "compile_after", "module_compile_after")


class Block(nn.Module):
    """A residual block: the unit zero3 gathers, frees and compiles as one piece."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


# zero3/hsdp: the blocks are units; inp and out hold the root unit's parameters. Pieces:
# inp, each block, out -> 3 graphs (the two blocks share one).
OPTIONS: dict[str, dict[str, Any]] = {
    "single": {}, "ddp": {}, "zero1": {}, "zero2": {"bucket_cap_mb": 0.0005},
    "zero3": {"wrap_classes": (Block,)}, "hsdp": {"wrap_classes": (Block,)},
}
GRAPHS = {"zero3": 3, "hsdp": 3}  # the others compile the user's module whole: 1


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g))
            for _ in range(STEPS)]


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


class _Counting:
    """aot_eager that counts the compiled forward and backward graphs' runs."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.runs = {"forward": 0, "backward": 0}

        def compiler(kind: str) -> Any:
            def compile_graph(gm: torch.fx.GraphModule, inputs: Any) -> Any:
                def run(*args: Any) -> Any:
                    self.runs[kind] += 1
                    return gm(*args)
                return make_boxed_func(run)
            return compile_graph

        self.backend = aot_autograd(fw_compiler=compiler("forward"),
                                    bw_compiler=compiler("backward"))


def _compiler_state() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


def _train(strategy: str | None, form: str, backend: Any, reset: bool = True) -> dict[str, Any]:
    """Train 10 steps; None: one plain process on the global batch. ``reset``: forget
    earlier compiles first (else same-kind pieces reuse their graphs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    if reset:
        torch._dynamo.reset()
        counters.clear()
    start = _compiler_state()
    net = plain = _net()
    names = list(dict(net.named_parameters()))
    if form == "compile_before":
        net = torch.compile(net, backend=backend)
    elif form == "module_compile_before":
        net.compile(backend=backend)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    rank, world = 0, 1
    model: nn.Module = net
    if strategy is not None:
        s = metadist.strategy(strategy, **OPTIONS[strategy])
        model, opt = s.setup(net, opt)
        rank, world = s.world.rank, s.world.world_size
    setup_model = model if strategy is not None else plain
    if form == "compile_after":
        model = torch.compile(model, backend=backend)
    elif form == "module_compile_after":
        model.compile(backend=backend)
    per = GLOBAL_BATCH // world
    warm: dict[str, int] = {}
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        loss = (model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]).square()
        loss.mean().backward()
        opt.step()
        if step == 0:
            warm = {k: v - start[k] for k, v in _compiler_state().items()}
    state = setup_model.state_dict()
    return {"params": {n: state[n].detach().clone() for n in names}, "keys": sorted(state),
            "warm": warm, "end": {k: v - start[k] for k, v in _compiler_state().items()}}


@cache
def _one_process(backend: str) -> dict[str, Any]:
    """One process compiled with ``backend`` ("eager": not compiled) on the global batch."""
    if backend == "eager":
        return _train(None, "eager", None)
    return _train(None, "compile_before", backend)


def _check(got: dict[str, Any], backend: str, graphs: int, where: str) -> None:
    """No graph break, ``graphs`` compiled in the first step and nothing after it, the
    user's state_dict keys, parameters as one compiled process has them."""
    assert got["keys"] == sorted(_net().state_dict()), f"{where}: state_dict keys"
    assert got["warm"]["breaks"] == 0, f"{where}: graph breaks {got['warm']}"
    assert got["warm"]["graphs"] == graphs, f"{where}: graphs {got['warm']}"
    assert got["end"] == got["warm"], f"{where}: compiled again after the first step"
    assert_tensors_close(got["params"], _one_process(backend)["params"], where)


def _forms_on_rank(strategies: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    """Every form of every strategy, in turn, with one counting backend: the first form of
    each kind of pieces compiles them, the later ones reuse those graphs."""
    counting = _Counting()
    out: dict[str, list[dict[str, Any]]] = {}
    for i, strategy in enumerate(strategies):
        out[strategy] = []
        for j, form in enumerate(FORMS):
            runs = dict(counting.runs)
            got = _train(strategy, form, counting.backend, reset=i == j == 0)
            got["runs"] = {k: counting.runs[k] - runs[k] for k in runs}
            out[strategy].append(got)
    return out


# (world size, nodes) -> strategies run there, in this order. hsdp's pieces and boundaries
# are zero3's (across nodes it only adds an all-reduce in backward, outside compiled code):
# one node here, so that it shares the pool and the compiled graphs.
LAYOUTS = {(1, 1): ("single",), (2, 1): ("ddp", "zero1", "zero2", "zero3", "hsdp"),
           (3, 1): ("zero3",)}


@cache
def _layout(n: int, nodes: int) -> tuple[dict[str, list[dict[str, Any]]], ...]:
    return tuple(run_on_ranks(_forms_on_rank, n, args=(LAYOUTS[n, nodes],), nnodes=nodes,
                              timeout=600))


@pytest.mark.parametrize("strategy,n,nodes", [(s, n, nodes) for (n, nodes), names in
                                              LAYOUTS.items() for s in names])
def test_every_form_compiles_and_matches_one_compiled_process(strategy: str, n: int,
                                                              nodes: int) -> None:
    graphs = GRAPHS.get(strategy, 1)
    pieces = 4 if graphs > 1 else 1  # piece forwards per step (zero3: inp, 2 blocks, out)
    names = LAYOUTS[n, nodes]
    # graphs are compiled by the first strategy with these pieces; later ones reuse them
    first = next(s for s in names if GRAPHS.get(s, 1) == graphs) == strategy
    for rank, results in enumerate(_layout(n, nodes)):
        for i, (form, got) in enumerate(zip(FORMS, results[strategy], strict=True)):
            where = f"{strategy} n={n} rank {rank} {form}"
            _check(got, "aot_eager", graphs if first and i == 0 else 0, where)
            # every piece ran compiled at every step, forward and backward
            assert got["runs"] == {"forward": pieces * STEPS, "backward": pieces * STEPS}, where
    # aot_eager computes what eager does: the comparison above is with one eager process too
    assert_tensors_close(_one_process("aot_eager")["params"], _one_process("eager")["params"],
                         "aot_eager vs eager")


def _inductor_on_rank() -> list[dict[str, Any]]:
    """ddp and zero3, compiled before and after setup; the second form reuses the graphs."""
    return [_train(strategy, form, "inductor", reset=False)
            for strategy in ("ddp", "zero3") for form in ("compile_before", "compile_after")]


def test_inductor_matches_one_compiled_process() -> None:
    _one_process("inductor")  # first: the ranks find ddp's graph in inductor's cache
    for rank, results in enumerate(run_on_ranks(_inductor_on_rank, 2, timeout=600)):
        for (strategy, form), got in zip([(s, f) for s in ("ddp", "zero3") for f in (
                "compile_before", "compile_after")], results, strict=True):
            graphs = GRAPHS.get(strategy, 1) if form == "compile_before" else 0
            _check(got, "inductor", graphs, f"{strategy} {form} rank {rank}")


# ----- layers metadist runs eagerly, inference, refusals -----------------------------------
class NormNet(Net):
    """Net with a BatchNorm: SyncBatchNorm under sync_batchnorm=True, whose collective runs
    eagerly between compiled pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.inp(x)))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _norm_net_run(strategy: str | None, form: str, backend: Any = None) -> dict[str, Any]:
    torch.manual_seed(0)
    net = NormNet()
    model: nn.Module = net
    if form == "compile_before":
        model = torch.compile(net, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank, world = 0, 1
    setup_model = net
    if strategy is not None:
        options = {**OPTIONS[strategy], "sync_batchnorm": True, "activation_checkpointing": Block}
        s = metadist.strategy(strategy, **options)
        model, opt = s.setup(model, opt)
        setup_model = model
        rank, world = s.world.rank, s.world.world_size
    if form == "compile_after":
        model = torch.compile(model, backend=backend)
    per = GLOBAL_BATCH // world
    for x, y in _data():
        opt.zero_grad()
        loss = (model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]).square()
        loss.mean().backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        x = _data()[0][0][rank * per:(rank + 1) * per]
        predicted = model(x)
        expected = type(net).forward(net, x) if strategy is None else None
    return {"state": {k: v.clone() for k, v in setup_model.state_dict().items()},
            "predicted": predicted, "expected": expected}


def _eager_layers_on_rank(strategy: str) -> list[dict[str, Any]]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    counting = _Counting()
    out = []
    for form in ("compile_before", "compile_after"):
        torch._dynamo.reset()
        counters.clear()
        got = _norm_net_run(strategy, form, counting.backend)
        got["compiler"] = _compiler_state()
        out.append(got)
    got["runs"] = dict(counting.runs)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_sync_batchnorm_and_checkpointing_run_eagerly_between_pieces(strategy: str) -> None:
    """SyncBatchNorm's collective and activation checkpointing's wrapper run eagerly; the
    blocks inside the checkpoint are compiled and so is their recomputation in backward
    (eager recomputation would not refill the compiled graph's saved tensors)."""
    want = _norm_net_run(None, "eager")  # one eager process: aot_eager computes the same
    for rank, results in enumerate(run_on_ranks(_eager_layers_on_rank, 2, args=(strategy,),
                                                timeout=600)):
        for form, got in zip(("compile_before", "compile_after"), results, strict=True):
            where = f"{strategy} {form} rank {rank}"
            # inp, the (shared) block, out in training; the same three in eval mode
            assert got["compiler"]["breaks"] == 0 and got["compiler"]["graphs"] == 6, where
            assert_tensors_close(got["state"], want["state"], where)
            per = GLOBAL_BATCH // 2
            assert_tensors_close({"eval": got["predicted"]},
                                 {"eval": want["predicted"][rank * per:(rank + 1) * per]}, where)
        # two forms of, per step, 4 pieces forward + 2 block recomputations and 4 backward,
        # then 4 pieces forward in eval mode
        assert results[-1]["runs"] == {"forward": 2 * (6 * STEPS + 4), "backward": 8 * STEPS}


def test_dp_refuses_compile_naming_ddp() -> None:
    from metadist.strategies.dp import DataParallelModule

    model = DataParallelModule(nn.Linear(2, 2), [0, 1])  # no GPU touched before forward
    for compiled in (torch.compile(model, backend="eager"), model):
        if compiled is model:
            model.compile(backend="eager")
        with pytest.raises(RuntimeError, match=r"strategy 'dp' is not supported.*'ddp'"):
            compiled(torch.randn(3, 2))


def test_compiled_twice_or_forward_replaced_is_refused() -> None:
    s = metadist.strategy("single")
    net = nn.Linear(2, 2)
    net.compile(backend="eager")
    with pytest.raises(ValueError, match="compiled twice"):
        s.setup_module(torch.compile(net, backend="eager"))
    net._compiled_call_impl = None
    net.forward = torch.compile(net.forward, backend="eager")  # type: ignore[method-assign]
    model = torch.compile(s.setup_module(net), backend="eager")
    with pytest.raises(RuntimeError, match="leave forward as the class defines it"):
        model(torch.randn(3, 2))


def _save_compiled(path: str, skip_load: str = "") -> list[bool]:
    """Save and load a compiled zero3 model in each format: each format loads into a model of
    its own, built from other weights, so a load that does nothing leaves it different.
    ``skip_load`` names a format whose load is made a no-op (the test of this test)."""
    from metadist.checkpoint import restore

    s = metadist.strategy("zero3", wrap_classes=(Block,))
    net = _net()
    with torch.no_grad():  # LayerNorm starts at ones and zeros: make every entry differ
        for p in net.parameters():
            p.add_(torch.randn_like(p))
    saved = s.setup_module(net)
    expected = {k: v.clone() for k, v in saved.state_dict().items()}
    out = []
    for seed, fmt in enumerate(("full", "sharded"), start=1):
        torch.manual_seed(seed)
        loaded = s.setup_module(Net())
        assert not any(torch.equal(v, loaded.state_dict()[k]) for k, v in expected.items())
        # every rank gathers the state dict through torch's wrapper (rank 0 alone: a hang)
        s.save(f"{path}/{fmt}", {"model": torch.compile(saved, backend="eager")}, format=fmt)
        apply = restore.Plan.apply
        if fmt == skip_load:
            restore.Plan.apply = lambda self: None  # type: ignore[method-assign]
        try:
            s.load(f"{path}/{fmt}", {"model": torch.compile(loaded, backend="eager")})
        finally:
            restore.Plan.apply = apply  # type: ignore[method-assign]
        out.append(all(torch.equal(v, loaded.state_dict()[k]) for k, v in expected.items()))
    return out


@pytest.mark.parametrize("skip_load", ["", "full", "sharded"])
def test_checkpoint_of_a_compiled_sharded_model(tmp_path: Any, skip_load: str) -> None:
    """Both formats restore a compiled zero3 model; with either format's load made a no-op
    (the test of the test) that format's check fails."""
    got = run_on_ranks(_save_compiled, 2, args=(str(tmp_path), skip_load), timeout=120)
    want = [fmt != skip_load for fmt in ("full", "sharded")]
    assert got == [want, want]
