"""zero3/hsdp parameters under the user's names and global shapes, as one process has them.

Reproduction (issue 41, observation 2): under zero3 ``[n for n, _ in
model.named_parameters()]`` was ``['shards.0', 'shards.1', ...]`` with flat shapes ``(72,)``,
``(16,)``, so parameter groups by name (weight decay for weights only, a learning rate per
layer), per-layer logging and freezing by name after setup could not be written. Now
``model.named_parameters()`` yields the user's names (under ``module.``, as every other
strategy's wrapper does) with global shapes, dtype, device and ``requires_grad``; each
parameter computes on this rank's slice of it, so an optimizer built on them after setup,
with or without ``strategy.setup_optimizer``, steps what one process steps.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close

STEPS, GLOBAL_BATCH = 10, 12
SHARDED = [("zero3", 1, 1), ("zero3", 2, 1), ("zero3", 3, 1), ("hsdp", 4, 2)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(torch.tanh(self.embed(x))))
        return self.head(h) / self.temperature


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _describe(named: Any) -> list[tuple[str, tuple[int, ...], str, bool, str]]:
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad, p.device.type)
            for n, p in named]


def _names_and_shapes(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    want = _describe(("module." + n, p) for n, p in net.named_parameters())
    want_count = sum(p.numel() for p in net.parameters())
    model = metadist.strategy(strategy, min_unit_params=10).setup_module(net)
    before = _describe(model.named_parameters())
    nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 3)).backward()
    after = _describe(model.named_parameters())  # the root unit is gathered until a step
    return {"want": want, "before": before, "after": after,
            "count": sum(p.numel() for p in model.parameters()),
            "want_count": want_count,
            "parameters": all(isinstance(p, nn.Parameter) for p in model.parameters())}


@pytest.mark.parametrize(("strategy", "n", "nodes"), SHARDED)
def test_named_parameters_are_the_users_names_and_global_shapes(strategy: str, n: int,
                                                                 nodes: int) -> None:
    for out in run_on_ranks(_names_and_shapes, n, args=(strategy,), nnodes=nodes):
        assert out["before"] == out["want"]
        assert out["after"] == out["want"]
        assert out["count"] == out["want_count"]
        assert out["parameters"]


def _groups(named: Any) -> list[dict[str, Any]]:
    """Weight decay for weights only, a learning rate of its own for the head: by name."""
    named = list(named)
    return [{"params": [p for n, p in named if n.endswith("weight") and "head" not in n],
             "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
            {"params": [p for n, p in named if n.endswith("head.weight")], "lr": 0.03}]


def _program(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             step: int) -> dict[str, float]:
    """One step as written for one process: per-layer gradient norms logged by name, the
    weights' gradient norm by hand, one gradient cleared by name on some steps."""
    nn.functional.mse_loss(model(x), y).backward()
    logged = {n: float(p.grad.norm()) for n, p in model.named_parameters()
              if p.grad is not None}
    logged["weights"] = float(torch.sqrt(sum(
        (p.grad.double() ** 2).sum() for n, p in model.named_parameters()
        if n.endswith("weight") and p.grad is not None)))
    if step % 3 == 2:
        next(p for n, p in model.named_parameters() if n.endswith("hidden.bias")).grad = None
    opt.step()
    opt.zero_grad()
    return logged


def _train(strategy: str, how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    s = metadist.strategy(strategy, min_unit_params=10)
    model = s.setup_module(net)
    fused = {"fused": True} if how == "plain_fused" else {}
    opt = torch.optim.AdamW(_groups(model.named_parameters()), lr=0.01, **fused)
    if how == "setup_optimizer":
        opt = s.setup_optimizer(model, opt)
    popt = torch.optim.AdamW(_groups(("module." + n, p) for n, p in plain.named_parameters()),
                             lr=0.01)
    w = metadist.world()
    per = GLOBAL_BATCH // w.world_size
    logs = []
    for step in range(STEPS):
        x, y = _batch(step)
        got = _program(model, opt, x[w.rank * per:(w.rank + 1) * per],
                       y[w.rank * per:(w.rank + 1) * per], step)
        want = _program(plain, popt, x, y, step)
        logs.append((got, {("module." + k if k != "weights" else k): v
                           for k, v in want.items()}))
    return {"got": model.state_dict(), "want": plain.state_dict(), "logs": logs}


@pytest.mark.parametrize("how", ["setup_optimizer", "plain", "plain_fused"])
@pytest.mark.parametrize(("strategy", "n", "nodes"), SHARDED)
def test_param_groups_by_name_after_setup_equal_one_process(strategy: str, n: int, nodes: int,
                                                            how: str) -> None:
    """Groups that cut across a unit's flat (weights and biases of one layer) split it
    (strategies/zero3/regroup.py) through setup_optimizer; a plain optimizer (its
    single-tensor or fused kernel) steps each parameter's slice with its group's
    hyperparameters."""
    for out in run_on_ranks(_train, n, args=(strategy, how), nnodes=nodes):
        assert_tensors_close(out["got"], out["want"])
        for got, want in out["logs"]:
            assert got.keys() == want.keys()
            for key in got:  # float32 norms of float32 gradients: 1e-5 relative
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def _refusals(strategy: str) -> dict[str, str]:
    torch.manual_seed(0)
    model = metadist.strategy(strategy, min_unit_params=10).setup_module(Net())
    params = dict(model.named_parameters())
    out = {}
    for name, call in {
        "matmul": lambda: params["module.embed.weight"] @ torch.randn(4, 2),
        "item": params["module.temperature"].item,
        "save": lambda: torch.save(params["module.head.bias"], "/dev/null"),
        "deepcopy": lambda: copy.deepcopy(params["module.head.bias"]),
    }.items():
        try:
            call()
            out[name] = "ran"
        except (RuntimeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize(("strategy", "n", "nodes"), [("zero3", 2, 1)])
def test_what_needs_the_whole_parameter_stops_naming_it(strategy: str, n: int,
                                                         nodes: int) -> None:
    expected = {"matmul": "matmul of 'embed.weight' reads or combines all",
                "item": "item of 'temperature' reads or combines all",
                "save": "__reduce_ex__ of 'head.bias' reads or combines all",
                "deepcopy": "__deepcopy__ of 'head.bias' reads or combines all"}
    for out in run_on_ranks(_refusals, n, args=(strategy,), nnodes=nodes):
        for name, text in expected.items():
            assert text in out[name], (name, out[name])
            assert "model.full_parameters()" in out[name], out[name]


def _freeze_a_layer(strategy: str, options: dict[str, Any],
                    what: str = "layer") -> dict[str, Any]:
    """A layer (or its weight alone, beside its bias in one flat) frozen by name after setup
    for a few steps, then trained again (a fine-tuning schedule), next to one process doing
    the same. Adam for the layer; SGD with momentum for the weight alone (Adam's one step
    count per flat cannot resume a part of it: unreached.py refuses that by name)."""
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    s = metadist.strategy(strategy, min_unit_params=10, **options)

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if what == "layer":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    model, opt = s.setup(net, optimizer(net.parameters()))
    popt = optimizer(plain.parameters())
    w = metadist.world()
    per = GLOBAL_BATCH // w.world_size
    for step in range(STEPS):
        for m in (model.module, plain):
            if step in (3, 7):
                (m.hidden if what == "layer" else m.hidden.weight).requires_grad_(step == 7)
        x, y = _batch(step)
        for m, o, xs, ys in ((model, opt, x[w.rank * per:(w.rank + 1) * per],
                              y[w.rank * per:(w.rank + 1) * per]), (plain, popt, x, y)):
            nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
            o.zero_grad()
    return {"got": model.state_dict(), "want": plain.state_dict()}


@pytest.mark.parametrize("options", [{}, {"reshard_after_forward": False}],
                         ids=["default", "no-reshard"])
@pytest.mark.parametrize(("strategy", "n", "nodes"), SHARDED[1:])
def test_a_layer_frozen_by_name_after_setup_trains_as_in_one_process(
        strategy: str, n: int, nodes: int, options: dict[str, Any]) -> None:
    """All of a flat's parameters frozen after setup: the flat is frozen (no gradient, no
    reduce-scatter, the optimizer skips it) until they are unfrozen (before: refused)."""
    for out in run_on_ranks(_freeze_a_layer, n, args=(strategy, options), nnodes=nodes):
        assert_tensors_close(out["got"], out["want"])


@pytest.mark.parametrize(("strategy", "n", "nodes"), SHARDED[1:])
def test_a_weight_frozen_apart_from_its_flat_trains_as_in_one_process(
        strategy: str, n: int, nodes: int) -> None:
    """A weight frozen after setup while the bias beside it in its flat trains (a FairScale
    user's requires_grad_(False) then refresh_trainable()): it gets no gradient and the
    step skips it, as one process's grad=None does (before: refused, and the message's
    fix froze the whole model)."""
    for out in run_on_ranks(_freeze_a_layer, n, args=(strategy, {}, "weight"), nnodes=nodes):
        assert_tensors_close(out["got"], out["want"])


def _plain_steps(plain: nn.Module, popt: torch.optim.Optimizer, steps: range) -> None:
    """One process on the whole batches."""
    for step in steps:
        x, y = _batch(step)
        nn.functional.mse_loss(plain(x), y).backward()
        popt.step()
        popt.zero_grad()


def _steps(s: metadist.Strategy, model: nn.Module, opt: torch.optim.Optimizer,
           steps: range) -> None:
    w = metadist.world()
    per = GLOBAL_BATCH // w.world_size
    for step in steps:
        x, y = _batch(step)
        s.backward(nn.functional.mse_loss(model(x[w.rank * per:(w.rank + 1) * per]),
                                          y[w.rank * per:(w.rank + 1) * per]))
        opt.step()
        opt.zero_grad()


def _resume(strategy: str, path: str, save: bool, fmt: str) -> dict[str, torch.Tensor]:
    """Groups by name built after setup (flats split), saved after 5 steps, loaded into a
    fresh set-up (another strategy or world size) and trained 5 more."""
    torch.manual_seed(0 if save else 7)
    s = metadist.strategy(strategy, **({"min_unit_params": 10} if strategy != "ddp" else {}))
    model = s.setup_module(Net())
    opt = s.setup_optimizer(model, torch.optim.AdamW(_groups(model.named_parameters()),
                                                     lr=0.01))
    if save:
        _steps(s, model, opt, range(5))
        s.save(path, {"model": model, "optimizer": opt}, format=fmt)
    else:
        s.load(path, {"model": model, "optimizer": opt})
        _steps(s, model, opt, range(5, STEPS))
    return model.state_dict()


@pytest.mark.parametrize(("saver", "n1", "fmt", "loader", "n2"),
                         [("zero3", 2, "sharded", "zero3", 3), ("zero3", 3, "sharded", "ddp", 2),
                          ("ddp", 2, "full", "zero3", 3)])
def test_groups_built_after_setup_save_and_reshard(tmp_path: Any, saver: str, n1: int,
                                                   fmt: str, loader: str, n2: int) -> None:
    torch.manual_seed(0)
    plain = Net()
    popt = torch.optim.AdamW(_groups(("module." + n, p) for n, p in plain.named_parameters()),
                             lr=0.01)
    _plain_steps(plain, popt, range(STEPS))
    path = str(tmp_path / "ckpt")
    run_on_ranks(_resume, n1, args=(saver, path, True, fmt))
    for got in run_on_ranks(_resume, n2, args=(loader, path, False, fmt)):
        assert_tensors_close(got, plain.state_dict())


def _state_by_parameter(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    s = metadist.strategy(strategy, min_unit_params=10)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    popt = torch.optim.Adam(plain.parameters(), lr=0.01)
    _steps(s, model, opt, range(3))
    _plain_steps(plain, popt, range(3))
    got = {n: (float(opt.state[p]["exp_avg_sq"].sum()), float(opt.state[p]["exp_avg"].norm()),
               float(opt.state[p]["step"])) for n, p in model.named_parameters()}
    want = {"module." + n: (float(popt.state[p]["exp_avg_sq"].sum()),
                            float(popt.state[p]["exp_avg"].norm()), float(popt.state[p]["step"]))
            for n, p in plain.named_parameters()}
    return {"got": got, "want": want}


@pytest.mark.parametrize(("strategy", "n", "nodes"), SHARDED[1:])
def test_optimizer_state_read_by_parameter(strategy: str, n: int, nodes: int) -> None:
    """``opt.state[p]`` of a set-up optimizer (which steps flat shards) for a parameter of
    ``model.parameters()``: its slice of the flat's state, whole reductions global."""
    for out in run_on_ranks(_state_by_parameter, n, args=(strategy,), nnodes=nodes):
        assert out["got"].keys() == out["want"].keys()
        for name, values in out["want"].items():  # float32 sums and norms: 1e-5 relative
            assert out["got"][name] == pytest.approx(values, rel=1e-5, abs=1e-9), name


def _local_and_full(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    s = metadist.strategy(strategy, min_unit_params=10)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    _steps(s, model, opt, range(3))
    _plain_steps(plain, torch.optim.Adam(plain.parameters(), lr=0.01), range(3))
    params = dict(model.named_parameters())
    full = {n: p.full_tensor() for n, p in params.items()}
    runs = {}
    for n, p in params.items():  # where this rank's slice sits in the whole, flattened
        local, whole = p.to_local(), full[n].detach().reshape(-1)
        runs[n] = next(k for k in range(whole.numel() - local.numel() + 1)
                       if torch.equal(whole[k:k + local.numel()], local))
    opt.zero_grad()
    loss = sum((f ** 2).sum() for f in full.values())
    assert isinstance(loss, torch.Tensor)
    loss.backward()  # into the shards
    grads = {n: (p.grad, 2 * p.to_local()) for n, p in params.items() if p.to_local().numel()}
    return {"full": {n: f.detach() for n, f in full.items()},
            "want": {"module." + n: p.detach() for n, p in plain.named_parameters()},
            "numel": {n: p.to_local().numel() for n, p in params.items()},
            "runs": runs, "grads": grads}


@pytest.mark.parametrize(("strategy", "n", "nodes"), SHARDED[1:])
def test_to_local_and_full_tensor_as_dtensor_gives_them(strategy: str, n: int,
                                                        nodes: int) -> None:
    """``p.to_local()`` is this rank's slice (the ranks' slices make up the parameter once
    per replica), ``p.full_tensor()`` the whole parameter, differentiable into the shards
    (the gradient of the same loss on every rank is one process's: averaged)."""
    outs = run_on_ranks(_local_and_full, n, args=(strategy,), nnodes=nodes)
    replicas = 2 if strategy == "hsdp" else 1
    for out in outs:
        assert_tensors_close(out["full"], out["want"])
        assert_tensors_close({n: g for n, (g, _) in out["grads"].items()},
                             {n: w for n, (_, w) in out["grads"].items()})
    for name, p in outs[0]["want"].items():
        assert sum(out["numel"][name] for out in outs) == replicas * p.numel(), name


def _full_grads(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    options = {"min_unit_params": 10} if strategy != "zero2" else {}
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    _steps(s, model, opt, range(2))
    _plain_steps(plain, torch.optim.Adam(plain.parameters(), lr=0.01), range(2))
    w = metadist.world()
    per = GLOBAL_BATCH // w.world_size
    x, y = _batch(2)
    s.backward(nn.functional.mse_loss(model(x[w.rank * per:(w.rank + 1) * per]),
                                      y[w.rank * per:(w.rank + 1) * per]))
    nn.functional.mse_loss(plain(x), y).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    doubled = {n: (p.grad * 2).full_tensor() for n, p in model.named_parameters()}
    want = {"module." + n: p.grad for n, p in plain.named_parameters()}
    try:
        next(iter(model.parameters())).grad.sum(0, keepdim=True).full_tensor()
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"got": got, "doubled": doubled, "want": want, "refused": refused}


@pytest.mark.parametrize(("strategy", "n", "nodes"),
                         [("zero2", 3, 1), ("zero3", 2, 1), ("zero3", 3, 1), ("hsdp", 4, 2)])
def test_gradients_full_tensor_is_the_whole_gradient(strategy: str, n: int,
                                                     nodes: int) -> None:
    """``p.grad.full_tensor()`` (collective, as DTensor's) is one process's gradient: a
    zero2 gradient's owner's values, a zero3/hsdp gradient's slices put together; a value
    computed element by element from it too; a reduction over part of a slice stops first."""
    for out in run_on_ranks(_full_grads, n, args=(strategy,), nnodes=nodes):
        assert_tensors_close(out["got"], out["want"])
        assert_tensors_close(out["doubled"], {k: 2 * v for k, v in out["want"].items()})
        if strategy != "zero2":
            assert "sum across the elements of a zero3/hsdp shard" in out["refused"]
