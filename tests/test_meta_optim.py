"""Differentiable optimisers (functional and module-bound), module cloning, snapshots and
functional calls: torch.optim parity, second-order MAML against hand-written autograd,
gradients through the optimiser state by finite differences, and tied weights."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import metadist
from metadist.meta import (
    AdamState,
    MetaAdam,
    MetaAdamW,
    MetaOptimizer,
    MetaSGD,
    adam,
    adamw,
    apply_updates,
    extract_state_dict,
    functional_call,
    module_clone,
    recover_state_dict,
    sgd,
)
from metadist.testing import run_on_ranks

RTOL, ATOL = 1.3e-6, 1e-5  # the parity protocol's tolerances (tests/parity.py)
STEPS, TASKS = 3, 3
SGD_LR, MOMENTUM = 0.05, 0.9
ADAM_LR, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-8


def _net(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # tanh: second derivatives must not vanish for second-order terms to matter
    return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


def _tasks(dtype: torch.dtype = torch.float32, count: int = TASKS) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    out: list[tuple[Tensor, ...]] = []
    for _ in range(count):
        amp, phase = 1 + 2 * torch.rand(1, generator=g), 3 * torch.rand(1, generator=g)
        x = (torch.rand(16, 1, generator=g) * 6 - 3).to(dtype)
        y = amp.to(dtype) * torch.sin(x + phase.to(dtype))
        out.append((x[:8], y[:8], x[8:], y[8:]))
    return out


def _mse(a: Tensor, b: Tensor) -> Tensor:
    return ((a - b) ** 2).mean()


# ----- the functional form against torch.optim -------------------------------------------------
CASES: dict[str, tuple[Callable[..., object], type[torch.optim.Optimizer], dict[str, object]]] = {
    "sgd": (sgd, torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (sgd, torch.optim.SGD,
                     {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.05}),
    "sgd_nesterov": (sgd, torch.optim.SGD,
                     {"lr": 0.1, "momentum": 0.8, "nesterov": True, "weight_decay": 0.05,
                      "maximize": True}),
    "adam": (adam, torch.optim.Adam, {"lr": 0.01}),
    "adam_decay": (adam, torch.optim.Adam,
                   {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1, "maximize": True}),
    "adamw": (adamw, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


@pytest.mark.parametrize("case", CASES)
def test_functional_matches_torch_optim(case: str) -> None:
    make, torch_cls, options = CASES[case]
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    ours: object = {"w": start[0].clone(), "b": (start[1].clone(),)}
    theirs = [t.clone().requires_grad_() for t in start]
    reference = torch_cls(theirs, **options)  # type: ignore[arg-type]
    transform = make(**options)
    state = transform.init(ours)  # type: ignore[attr-defined]
    for _ in range(10):
        grads = [torch.randn(t.shape, generator=g) for t in start]
        for t, grad in zip(theirs, grads, strict=True):
            t.grad = grad.clone()
        reference.step()
        updates, state = transform.update(  # type: ignore[attr-defined]
            {"w": grads[0], "b": (grads[1],)}, state, params=ours)
        ours = apply_updates(ours, updates)
    torch.testing.assert_close(ours["w"], theirs[0].detach(), rtol=RTOL, atol=ATOL)  # type: ignore[index]
    torch.testing.assert_close(ours["b"][0], theirs[1].detach(), rtol=RTOL, atol=ATOL)  # type: ignore[index]
    if isinstance(state, AdamState):
        torch.testing.assert_close(state.nu["w"], reference.state[theirs[0]]["exp_avg_sq"],
                                   rtol=RTOL, atol=ATOL)


def test_inplace_update_reuses_storage_and_equals_out_of_place() -> None:
    params = {"w": torch.randn(5)}
    transform = sgd(0.1, momentum=0.9)
    state = transform.init(params)
    for _ in range(2):
        grads = {"w": torch.randn(5)}
        want, want_state = transform.update({"w": grads["w"].clone()}, state, params=params)
        got, got_state = transform.update(grads, state, params=params, inplace=True)
        assert got["w"] is grads["w"] and got_state.momentum["w"] is state.momentum["w"]
        torch.testing.assert_close(got["w"], want["w"])
        torch.testing.assert_close(got_state.momentum["w"], want_state.momentum["w"])
        state = got_state
    before = params["w"]
    assert apply_updates(params, got, inplace=True)["w"] is before


# ----- second-order MAML against hand-written autograd ---------------------------------------
def _reference_meta_grads(kind: str, net: nn.Module, first_order: bool = False) -> list[Tensor]:
    names = [n for n, _ in net.named_parameters()]
    leaves = [p for _, p in net.named_parameters()]
    total = [torch.zeros_like(p) for p in leaves]
    for xs, ys, xq, yq in _tasks(leaves[0].dtype):
        params = list(leaves)
        m = [torch.zeros_like(p) for p in leaves]
        v = [torch.zeros_like(p) for p in leaves]
        for k in range(STEPS):
            loss = _mse(torch.func.functional_call(net, dict(zip(names, params, strict=True)),
                                                   (xs,)), ys)
            grads = torch.autograd.grad(loss, params, create_graph=not first_order)
            if kind == "sgd":  # torch's momentum: the first step's buffer is the gradient
                m = list(grads) if k == 0 else [MOMENTUM * b + g
                                                for b, g in zip(m, grads, strict=True)]
                params = [p - SGD_LR * b for p, b in zip(params, m, strict=True)]
            else:
                m = [B1 * a + (1 - B1) * g for a, g in zip(m, grads, strict=True)]
                v = [B2 * a + (1 - B2) * g * g for a, g in zip(v, grads, strict=True)]
                params = [p - ADAM_LR * (a / (1 - B1 ** (k + 1)))
                          / ((b / (1 - B2 ** (k + 1))).sqrt() + EPS)
                          for p, a, b in zip(params, m, v, strict=True)]
        query = _mse(torch.func.functional_call(net, dict(zip(names, params, strict=True)),
                                                (xq,)), yq)
        grads = torch.autograd.grad(query / TASKS, leaves)
        total = [a + g for a, g in zip(total, grads, strict=True)]
    return total


def _meta_optimizer(kind: str, module: nn.Module, create_graph: bool = True) -> MetaOptimizer:
    if kind == "sgd":
        return MetaSGD(module, SGD_LR, momentum=MOMENTUM, create_graph=create_graph)
    return MetaAdam(module, ADAM_LR, betas=(B1, B2), eps=EPS, create_graph=create_graph)


@pytest.mark.parametrize("how", ["clone", "recover"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_second_order_maml_matches_hand_written_autograd(kind: str, how: str) -> None:
    net = _net()
    want = _reference_meta_grads(kind, net)
    originals = list(net.parameters())
    snapshot = extract_state_dict(net, by="reference")
    for xs, ys, xq, yq in _tasks():
        # Either a fresh in-graph clone per task, or the net itself restored after each task.
        learner = module_clone(net, by="copy") if how == "clone" else net
        opt = _meta_optimizer(kind, learner)
        for _ in range(STEPS):
            opt.step(_mse(learner(xs), ys))
        (_mse(learner(xq), yq) / TASKS).backward()
        if how == "recover":
            recover_state_dict(net, snapshot)
    assert all(a is b for a, b in zip(net.parameters(), originals, strict=True))
    for p, w in zip(net.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=RTOL, atol=ATOL)


def test_first_order_maml_drops_second_order_terms() -> None:
    net = _net()
    want = _reference_meta_grads("sgd", net, first_order=True)
    for xs, ys, xq, yq in _tasks():
        learner = module_clone(net, by="copy")
        opt = _meta_optimizer("sgd", learner, create_graph=False)
        for _ in range(STEPS):
            opt.step(_mse(learner(xs), ys))
        (_mse(learner(xq), yq) / TASKS).backward()
    for p, w in zip(net.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=RTOL, atol=ATOL)


# ----- under a strategy: one in-graph clone per task, outer backward synced by the reducer ---
META_TASKS, META_STEPS = 4, 3


def _maml_steps(model: nn.Module, backward: Callable[[Tensor], None],
                step: Callable[[], None], tasks: list[tuple[Tensor, ...]]) -> None:
    for _ in range(META_STEPS):
        for xs, ys, xq, yq in tasks:
            learner = module_clone(model, by="copy")
            inner = MetaSGD(learner, SGD_LR, momentum=MOMENTUM)
            for _ in range(STEPS):
                inner.step(_mse(learner(xs), ys))
            backward(_mse(learner(xq), yq) / len(tasks))
        step()


def _maml_on_rank(strategy: str) -> dict[str, Tensor]:
    w = metadist.world()
    net = _net()
    s = metadist.strategy(strategy, **({"min_unit_params": 10} if strategy == "zero3" else {}))
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    per = META_TASKS // w.world_size
    mine = _tasks(count=META_TASKS)[w.rank * per:(w.rank + 1) * per]

    def step() -> None:
        opt.step()
        opt.zero_grad()

    # The wrapped model, not model.module: zero2 refreshes parameters after step()
    # asynchronously, and module_clone must wait for that before copying them.
    _maml_steps(model, s.backward, step, mine)
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_meta_sgd_clones_under_a_strategy_match_one_process(strategy: str) -> None:
    """zero3: the clone is a copy of the user's module on the full parameters, and the
    outer backward reaches the shards through it."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    _maml_steps(net, lambda loss: loss.backward(), step, _tasks(count=META_TASKS))
    for got in run_on_ranks(_maml_on_rank, 2, args=(strategy,)):
        for name, p in net.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=RTOL, atol=ATOL)


def _zero3_refuses_in_place_tools() -> list[str]:
    net = _net()
    s = metadist.strategy("zero3", min_unit_params=10)
    model, _ = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    messages = []
    # Stepping or restoring the wrapped model in place cannot work: its modules hold shards.
    for tool in (lambda: MetaSGD(model, 0.1), lambda: extract_state_dict(model)):
        with pytest.raises(ValueError, match="holds parameter shards") as info:
            tool()
        messages.append(str(info.value))
    return messages


def test_sharded_strategies_point_to_the_functional_form() -> None:
    for messages in run_on_ranks(_zero3_refuses_in_place_tools, 2):
        for message in messages:
            assert "model.full_parameters()" in message and "functional_forward" in message


# ----- gradients through the learning rate and the optimiser state, by finite differences ------
OPTIMISERS: dict[str, Callable[[nn.Module, Tensor], MetaOptimizer]] = {
    "sgd_nesterov": lambda m, lr: MetaSGD(m, lr, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda m, lr: MetaAdam(m, lr, weight_decay=0.01),
    "adamw": MetaAdamW,
}


@pytest.mark.parametrize("kind", OPTIMISERS)
def test_gradients_through_lr_and_state_match_finite_differences(kind: str) -> None:
    base = _net(torch.float64)
    xs, ys, xq, yq = _tasks(torch.float64)[0]
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    g = torch.Generator().manual_seed(3)
    direction = {n: torch.randn(p.shape, generator=g, dtype=torch.float64)
                 for n, p in start.items()}

    def query_loss(lr: Tensor, theta: dict[str, Tensor]) -> Tensor:
        learner = module_clone(base, by="deepcopy")
        recover_state_dict(learner, theta)
        opt = OPTIMISERS[kind](learner, lr)
        for _ in range(4):
            opt.step(_mse(learner(xs), ys))
        # The state is part of the graph (it carries the lr of earlier steps and theta).
        state = [t for t in torch.utils._pytree.tree_leaves(opt.state) if isinstance(t, Tensor)]
        assert state and all(t.requires_grad for t in state)
        return _mse(learner(xq), yq)

    lr = torch.tensor(0.03, dtype=torch.float64, requires_grad=True)
    theta = {n: t.clone().requires_grad_() for n, t in start.items()}
    grads = torch.autograd.grad(query_loss(lr, theta), [lr, *theta.values()])
    h = 1e-6  # central differences in float64: O(h^2) truncation, ~1e-10 rounding

    def at(shift: float) -> dict[str, Tensor]:  # the inner loop needs parameters with grad
        return {n: (t + shift * direction[n]).requires_grad_() for n, t in start.items()}

    d_lr = (query_loss(lr.detach() + h, at(0)) - query_loss(lr.detach() - h, at(0))) / (2 * h)
    d_theta = (query_loss(lr.detach(), at(h)) - query_loss(lr.detach(), at(-h))) / (2 * h)
    along = sum((gr * direction[n]).sum() for gr, n in zip(grads[1:], start, strict=True))
    torch.testing.assert_close(grads[0], d_lr, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(along, d_theta, rtol=1e-6, atol=1e-9)


# ----- clones, snapshots, state dicts -----------------------------------------------------------
class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("shift", torch.ones(2))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + self.shift


def test_module_clone_modes() -> None:
    net, x = _WithBuffer(), torch.randn(4, 3)
    ref = module_clone(net, by="reference")
    assert ref.lin.weight is net.lin.weight and ref.shift is net.shift
    MetaSGD(ref, 0.1).step(ref(x).sum())  # rebinds the clone's slots only
    assert not ref.lin.weight.is_leaf and isinstance(net.lin.weight, nn.Parameter)

    want = torch.autograd.grad(net(x).pow(2).sum(), net.lin.weight)[0]
    cop = module_clone(net, by="copy")
    assert cop.lin.weight is not net.lin.weight and cop.lin.weight.grad_fn is not None
    cop(x).pow(2).sum().backward()  # reaches the original through the clone
    torch.testing.assert_close(net.lin.weight.grad, want)

    net.zero_grad(set_to_none=True)
    deep = module_clone(net, by="deepcopy")
    assert isinstance(deep.lin.weight, nn.Parameter) and deep.lin.weight.is_leaf
    assert deep.lin.weight.data_ptr() != net.lin.weight.data_ptr()
    deep(x).sum().backward()
    assert net.lin.weight.grad is None and deep.lin.weight.grad is not None

    net.shift = net.lin.bias * 2  # a buffer inside the graph  # type: ignore[assignment]
    assert module_clone(net, by="copy").shift.requires_grad
    assert not module_clone(net, by="copy", detach_buffers=True).shift.requires_grad


@pytest.mark.parametrize("by", ["reference", "copy", "deepcopy"])
def test_extract_recover_round_trip(by: str) -> None:
    net, x = _WithBuffer(), torch.randn(4, 3)
    before = {n: t.detach().clone() for n, t in net.state_dict().items()}
    objects = dict(net.named_parameters())
    snap = extract_state_dict(net, by=by)  # type: ignore[arg-type]
    assert set(snap) == {"lin.weight", "lin.bias", "shift"}
    assert set(extract_state_dict(net, with_buffers=False)) == {"lin.weight", "lin.bias"}
    opt = MetaSGD(net, 0.1)
    for _ in range(2):
        opt.step(net(x).pow(2).sum())
    assert not torch.equal(net.lin.weight, before["lin.weight"])
    recover_state_dict(net, snap)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    for name, p in net.named_parameters():
        assert (p is objects[name]) == (by == "reference")
        assert p.is_leaf == (by != "copy")
    with pytest.raises(KeyError, match="does not have"):
        recover_state_dict(net, {"nope.weight": torch.zeros(1)})


def test_optimizer_snapshot_and_state_dict_resume_identically() -> None:
    x = torch.randn(6, 3)
    a = _WithBuffer()
    b = copy.deepcopy(a)
    opt_a = MetaAdam(a, 0.05)
    for _ in range(2):
        opt_a.step(a(x).pow(2).mean())
    snap = extract_state_dict(opt_a, by="deepcopy")
    saved = opt_a.state_dict()
    opt_a.step(a(x).pow(2).mean())
    recover_state_dict(opt_a, snap)  # back to the state after two steps
    assert opt_a.state.steps == 2 and not opt_a.state.mu["lin.weight"].requires_grad
    recover_state_dict(opt_a, saved["state"])
    # b continues from a's parameters and optimiser state after two steps: same trajectory.
    a = module_clone(a, by="deepcopy")
    recover_state_dict(b, extract_state_dict(a, by="deepcopy"))
    opt_a, opt_b = MetaAdam(a, 0.05), MetaAdam(b, 0.05)
    opt_a.load_state_dict(saved)
    opt_b.load_state_dict(saved)
    for _ in range(3):
        opt_a.step(a(x).pow(2).mean())
        opt_b.step(b(x).pow(2).mean())
    torch.testing.assert_close(a.lin.weight, b.lin.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not fit"):
        MetaSGD(b, 0.1, momentum=0.9).load_state_dict(saved)


# ----- tied weights ---------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_tied_weights_stay_tied_and_meta_gradients_match() -> None:
    net = _Tied()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    # Reference: the tied weight appears once in named_parameters; functional_call ties it.
    leaves = dict(net.named_parameters())
    assert list(leaves) == ["a.weight", "a.bias", "b.bias"]
    params = dict(leaves)
    for _ in range(STEPS):
        loss = _mse(torch.func.functional_call(net, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {n: p - SGD_LR * g for (n, p), g in zip(params.items(), grads, strict=True)}
    want = torch.autograd.grad(_mse(torch.func.functional_call(net, params, (x,)), y),
                               list(leaves.values()))

    snap = extract_state_dict(net, by="copy")
    assert snap["a.weight"] is snap["b.weight"]
    opt = MetaSGD(net, SGD_LR)
    assert list(opt.params) == ["a.weight", "a.bias", "b.bias"]
    for _ in range(STEPS):
        opt.step(_mse(net(x), y))
        assert net.a.weight is net.b.weight and not net.a.weight.is_leaf
    _mse(net(x), y).backward()
    for p, w in zip(leaves.values(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=RTOL, atol=ATOL)
    for by in ("reference", "copy", "deepcopy"):
        clone = module_clone(net, by=by)
        assert clone.a.weight is clone.b.weight


# ----- functional_call, grad_sync and errors --------------------------------------------------
def test_functional_call_takes_a_dict_or_a_tuple() -> None:
    net, x = _WithBuffer(), torch.randn(2, 3)
    zeros = (torch.zeros(2, 3), torch.zeros(2))
    torch.testing.assert_close(functional_call(net, zeros, (x,)), torch.ones(2, 2))
    torch.testing.assert_close(functional_call(net, {"lin.bias": torch.ones(2)}, x),
                               net.lin(x) + 1 + net.shift - net.lin.bias)
    with pytest.raises(ValueError, match="got 1 tensors for a module with 2 parameters"):
        functional_call(net, zeros[:1], (x,))


def test_grad_sync_applies_to_inner_gradients() -> None:
    x = torch.randn(4, 3)
    doubled, plain = _WithBuffer(), _WithBuffer()
    plain.load_state_dict(doubled.state_dict())
    MetaSGD(doubled, 0.1, grad_sync=lambda gs: tuple(2 * g for g in gs)).step(doubled(x).sum())
    MetaSGD(plain, 0.2).step(plain(x).sum())
    torch.testing.assert_close(doubled.lin.weight, plain.lin.weight)


def test_errors_say_what_to_do() -> None:
    net = _WithBuffer()
    with pytest.raises(ValueError, match="choose one of: reference, copy, deepcopy"):
        module_clone(net, by="shallow")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"betas\[0\]=1.0 is invalid"):
        adam(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="needs the current parameters"):
        adamw().update({"w": torch.ones(1)}, adamw().init({"w": torch.ones(1)}))
    with pytest.raises(ValueError, match="structure of the parameters"):
        apply_updates({"w": torch.ones(1)}, {"v": torch.ones(1)})
    with pytest.raises(TypeError, match=r"binds to an nn\.Module"):
        MetaSGD(torch.ones(1), 0.1)  # type: ignore[arg-type]
    opt = MetaSGD(net, 0.1)
    with pytest.raises(ValueError, match="does not require grad"):
        opt.step(torch.tensor(1.0))
    with pytest.raises(ValueError, match="scalar loss"):
        opt.step(net(torch.ones(2, 3)))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        MetaAdam(frozen)
