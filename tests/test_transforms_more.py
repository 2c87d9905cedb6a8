"""The adaptive optimisers, TorchOpt's extra flags, chain and its building blocks: torch.optim
parity in float64, hypergradients through unrolled steps against finite differences, and the
module-bound Meta* optimisers."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from metadist.meta import (
    MetaAdaDelta,
    MetaAdaGrad,
    MetaAdaMax,
    MetaAdamW,
    MetaOptimizer,
    MetaRAdam,
    MetaRMSProp,
    Transformation,
    adadelta,
    adagrad,
    adam,
    adamax,
    adamw,
    add_decayed_weights,
    apply_updates,
    chain,
    clip_grad_norm,
    module_clone,
    nan_to_num,
    radam,
    rmsprop,
    scale,
    scale_by_schedule,
    sgd,
)

F64 = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-12}
Params = dict[str, Tensor]


def _data() -> tuple[Params, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    w, b, x, y = (torch.randn(*shape, generator=g, dtype=F64)
                  for shape in ((3, 2), (2,), (8, 3), (8, 2)))
    return {"w": w, "b": b}, x, y


def _loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
    return ((torch.tanh(x @ p["w"]) + p["b"] - y) ** 2).mean()


def _grads(params: Params, x: Tensor, y: Tensor) -> Params:
    """Detached gradients of the loss at ``params`` (the parity protocol's inputs)."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    grads = torch.autograd.grad(_loss(leaves, x, y), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def _ours(transform: Transformation, steps: int = 10) -> tuple[Params, Any]:
    params, x, y = _data()
    state = transform.init(params)
    for _ in range(steps):
        updates, state = transform.update(_grads(params, x, y), state, params=params)
        params = apply_updates(params, updates)
    return params, state


def _torch(make: Callable[[list[Tensor]], torch.optim.Optimizer], steps: int = 10,
           clip: float | None = None) -> Params:
    start, x, y = _data()
    params = {k: v.clone().requires_grad_() for k, v in start.items()}
    opt = make(list(params.values()))
    for _ in range(steps):
        opt.zero_grad()
        _loss(params, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
    return {k: v.detach() for k, v in params.items()}


# ----- parity with torch.optim: (ours, torch's optimiser, shared options, our-only options) ---
def _weights_only_adamw(ps: list[Tensor], **options: Any) -> torch.optim.Optimizer:
    """AdamW decaying only the even-numbered tensors (the weights: w, or Linear weights)."""
    return torch.optim.AdamW([{"params": ps[0::2]}, {"params": ps[1::2], "weight_decay": 0.0}],
                             **options)


def _prefilled_rmsprop(ps: list[Tensor], **options: Any) -> torch.optim.Optimizer:
    """torch's RMSprop started from square averages of 0.4 (TorchOpt's ``initial_scale``):
    torch initialises a parameter's state only while it is empty."""
    opt = torch.optim.RMSprop(ps, **options)
    for p in ps:
        opt.state[p] = {"step": torch.tensor(0.0), "square_avg": torch.full_like(p, 0.4),
                        "momentum_buffer": torch.zeros_like(p)}
    return opt


WEIGHTS_ONLY = {"mask": lambda p: {k: v.ndim == 2 for k, v in p.items()}}
CASES: dict[str, tuple[Callable[..., Transformation], Callable[..., torch.optim.Optimizer],
                       dict[str, Any], dict[str, Any]]] = {
    "rmsprop": (rmsprop, torch.optim.RMSprop, {}, {}),
    "rmsprop_all": (rmsprop, torch.optim.RMSprop,
                    {"lr": 0.02, "alpha": 0.9, "eps": 1e-6, "weight_decay": 0.1,
                     "momentum": 0.8, "centered": True, "maximize": True},
                    {"moment_requires_grad": True}),
    "rmsprop_initial_scale": (rmsprop, _prefilled_rmsprop, {"lr": 0.02, "momentum": 0.5},
                              {"initial_scale": 0.4}),
    "adagrad": (adagrad, torch.optim.Adagrad, {}, {}),
    "adagrad_all": (adagrad, torch.optim.Adagrad,
                    {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.1,
                     "initial_accumulator_value": 0.3, "eps": 1e-8, "maximize": True}, {}),
    "adadelta": (adadelta, torch.optim.Adadelta, {}, {}),
    "adadelta_all": (adadelta, torch.optim.Adadelta,
                     {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.1, "maximize": True},
                     {"moment_requires_grad": True}),
    "adamax": (adamax, torch.optim.Adamax, {}, {}),
    "adamax_all": (adamax, torch.optim.Adamax,
                   {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1,
                    "maximize": True}, {"moment_requires_grad": True}),
    "radam": (radam, torch.optim.RAdam, {}, {}),  # 10 steps: both sides of rho_t > 5
    "radam_all": (radam, torch.optim.RAdam,
                  {"lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1,
                   "maximize": True}, {"moment_requires_grad": True}),
    "radam_decoupled": (radam, torch.optim.RAdam,
                        {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}, {}),
    "adam_flags": (adam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1},
                   {"eps_root": 0.0, "moment_requires_grad": True}),
    "adamw_flags": (adamw, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1},
                    {"moment_requires_grad": True, "mask": {"w": True, "b": True}}),
    "adamw_mask": (adamw, _weights_only_adamw, {"lr": 0.01, "weight_decay": 0.1},
                   {"mask": {"w": True, "b": False}}),
    "adamw_mask_callable": (adamw, _weights_only_adamw, {"lr": 0.01}, WEIGHTS_ONLY),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_torch_optim(case: str) -> None:
    make, torch_optimizer, shared, extra = CASES[case]
    got, state = _ours(make(**shared, **extra))
    want = _torch(lambda ps: torch_optimizer(ps, **shared))
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)
    moments = [t for t in tree_leaves(state) if isinstance(t, Tensor)]
    assert moments and all(t.requires_grad == extra.get("moment_requires_grad", False)
                           for t in moments)


def _reference(name: str, steps: int = 4) -> Params:
    """TorchOpt-only variants, written out: adam's eps_root and rmsprop's nesterov."""
    params, x, y = _data()
    lr, b1, b2, eps, mom = 0.01, 0.9, 0.999, 1e-8, 0.8
    m, v = ({k: torch.zeros_like(t) for k, t in params.items()} for _ in range(2))
    for t in range(1, steps + 1):
        for k, g in _grads(params, x, y).items():
            v[k] = b2 * v[k] + (1 - b2) * g * g if name == "adam" else 0.99 * v[k] + 0.01 * g * g
            if name == "adam":
                m[k] = b1 * m[k] + (1 - b1) * g
                nu_hat = v[k] / (1 - b2**t)
                params[k] = params[k] - lr * (m[k] / (1 - b1**t)) / ((nu_hat + 1e-3).sqrt() + eps)
            else:
                u = g / (v[k].sqrt() + eps)
                m[k] = mom * m[k] + u
                params[k] = params[k] - lr * (u + mom * m[k])
    return params


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_torchopt_only_variants_match_their_formulas(name: str) -> None:
    transform = (adam(0.01, eps_root=1e-3) if name == "adam"
                 else rmsprop(0.01, momentum=0.8, nesterov=True))
    got, want = _ours(transform, steps=4)[0], _reference(name)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)


# ----- hypergradients through unrolled steps, against central finite differences ---------------
HYPER: dict[str, tuple[Callable[[Tensor], Transformation], int]] = {
    "rmsprop": (lambda lr: rmsprop(lr, centered=True, momentum=0.5, weight_decay=0.01), 3),
    "rmsprop_nesterov": (lambda lr: rmsprop(lr, momentum=0.5, nesterov=True), 3),
    "adagrad": (lambda lr: adagrad(lr, lr_decay=0.1, weight_decay=0.01), 3),
    "adadelta": (lambda lr: adadelta(lr * 10, weight_decay=0.01), 3),
    "adamax": (lambda lr: adamax(lr, weight_decay=0.01), 3),
    "radam": (lambda lr: radam(lr, weight_decay=0.01, decoupled_weight_decay=True), 7),
    "adam_eps_root": (lambda lr: adam(lr, eps_root=1e-4, moment_requires_grad=True), 3),
    "adamw_mask": (lambda lr: adamw(lr, weight_decay=0.1, mask={"w": True, "b": False}), 3),
    "chain": (lambda lr: chain(clip_grad_norm(100.0), add_decayed_weights(0.01),
                               scale_by_schedule(lambda t: 1 / (1 + t)), scale(-lr)), 3),
    "clip_differentiable": (lambda lr: chain(clip_grad_norm(0.05, differentiable_norm=True),
                                             sgd(lr, momentum=0.9)), 3),
}


@pytest.mark.parametrize("case", HYPER)
def test_hypergradient_matches_finite_differences(case: str) -> None:
    make, steps = HYPER[case]
    start, x, y = _data()
    xq = x.flip(0)
    g = torch.Generator().manual_seed(1)
    direction = {k: torch.randn(v.shape, generator=g, dtype=F64) for k, v in start.items()}

    def outer(lr: Tensor, theta: Params) -> Tensor:
        transform, params = make(lr), dict(theta)
        state = transform.init(params)
        for _ in range(steps):
            grads = torch.autograd.grad(_loss(params, x, y), list(params.values()),
                                        create_graph=True)
            updates, state = transform.update(dict(zip(params, grads, strict=True)), state,
                                              params=params)
            params = apply_updates(params, updates)
        return _loss(params, xq, y)

    lr = torch.tensor(0.03, dtype=F64, requires_grad=True)
    theta = {k: v.clone().requires_grad_() for k, v in start.items()}
    d_lr, *d_theta = torch.autograd.grad(outer(lr, theta), [lr, *theta.values()])
    h = 1e-6

    def at(shift: float) -> Params:
        return {k: (v + shift * direction[k]).requires_grad_() for k, v in start.items()}

    fd_lr = (outer(lr.detach() + h, at(0)) - outer(lr.detach() - h, at(0))) / (2 * h)
    fd_theta = (outer(lr.detach(), at(h)) - outer(lr.detach(), at(-h))) / (2 * h)
    along = sum((d * direction[k]).sum() for d, k in zip(d_theta, start, strict=True))
    torch.testing.assert_close(d_lr, fd_lr, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(along, fd_theta, rtol=1e-6, atol=1e-9)


# ----- chain and its building blocks -----------------------------------------------------------
@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipping active, inactive
def test_chain_clip_then_sgd_matches_clip_grad_norm_and_torch_sgd(max_norm: float) -> None:
    got, state = _ours(chain(clip_grad_norm(max_norm), sgd(0.1, momentum=0.9)))
    want = _torch(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), clip=max_norm)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)
    assert isinstance(state, tuple) and len(state) == 2 and state[1].steps == 10


def test_building_blocks() -> None:
    params = {"w": torch.ones(2, dtype=F64), "b": torch.full((3,), 2.0, dtype=F64)}
    grads = {"w": torch.tensor([3.0, 4.0], dtype=F64), "b": torch.zeros(3, dtype=F64)}
    # inf-norm clipping: the largest entry becomes max_norm (up to torch's 1e-6 guard)
    clip = clip_grad_norm(2.0, float("inf"))
    clipped, _ = clip.update(grads, clip.init(params))
    torch.testing.assert_close(clipped["w"], grads["w"] * (2.0 / (4.0 + 1e-6)))
    updates, state = chain().update(grads, chain().init(params))  # the identity
    assert updates["w"] is grads["w"] and state == ()
    decay = add_decayed_weights(0.5, mask={"w": False, "b": True})
    updates, _ = decay.update(grads, decay.init(params), params=params)
    torch.testing.assert_close(updates["b"], torch.ones(3, dtype=F64))
    assert updates["w"] is grads["w"]
    schedule = scale_by_schedule(lambda t: 0.5**t)
    state = schedule.init(params)
    for t in range(3):
        updates, state = schedule.update(grads, state)
        torch.testing.assert_close(updates["w"], grads["w"] * 0.5**t)
    bad = {"w": torch.tensor([float("nan"), float("inf")]), "b": torch.zeros(3)}
    fixed, _ = nan_to_num(posinf=9.0).update(bad, nan_to_num().init(bad))
    assert fixed["w"].tolist() == [0.0, 9.0]
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        clip_grad_norm(1.0, error_if_nonfinite=True).update(bad, clip.init(bad))
    with pytest.raises(TypeError, match="tuple of states"):
        chain(scale(1.0), sgd(0.1)).update(grads, ())
    with pytest.raises(ValueError, match="structure of the parameters"):
        _ours(adamw(0.01, mask={"w": True}))
    with pytest.raises(ValueError, match="needs momentum > 0"):
        rmsprop(nesterov=True)


def test_chain_inplace_equals_out_of_place() -> None:
    transform = chain(clip_grad_norm(0.5), rmsprop(0.1, momentum=0.9, centered=True))
    params = {"w": torch.randn(5, dtype=F64)}
    state = transform.init(params)
    for _ in range(3):
        grads = {"w": torch.randn(5, dtype=F64)}
        want, want_state = transform.update({"w": grads["w"].clone()}, state, params=params)
        got, state = transform.update(grads, state, params=params, inplace=True)
        assert got["w"] is grads["w"]
        torch.testing.assert_close(got["w"], want["w"], **TOL)
        for a, b in zip(tree_leaves(state), tree_leaves(want_state), strict=True):
            torch.testing.assert_close(a, b, **TOL)


# ----- the module-bound optimisers -------------------------------------------------------------
META: dict[str, tuple[Callable[..., MetaOptimizer], Callable[..., torch.optim.Optimizer],
                      dict[str, Any]]] = {
    "rmsprop": (MetaRMSProp, torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "adagrad": (MetaAdaGrad, torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.1}),
    "adadelta": (MetaAdaDelta, torch.optim.Adadelta, {"weight_decay": 0.01}),
    "adamax": (MetaAdaMax, torch.optim.Adamax, {}),
    "radam": (MetaRAdam, torch.optim.RAdam, {"lr": 0.01}),
    "adamw_mask": (lambda m, **kw: MetaAdamW(m, **kw, **WEIGHTS_ONLY), _weights_only_adamw,
                   {"lr": 0.01}),
}


@pytest.mark.parametrize("kind", META)
def test_meta_optimizers_step_a_module_like_torch_optim(kind: str) -> None:
    make_meta, make_torch, options = META[kind]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(F64)
    reference = copy.deepcopy(net)
    _, x, y = _data()
    learner = module_clone(net, by="copy")
    opt = make_meta(learner, **options)
    ref_opt = make_torch(list(reference.parameters()), **options)
    for _ in range(7):
        opt.step(((learner(x) - y) ** 2).mean())
        ref_opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        ref_opt.step()
    for (name, p), q in zip(learner.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q.detach(), **TOL, msg=name)
    ((learner(x.flip(0)) - y) ** 2).mean().backward()  # second order, into the originals
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
