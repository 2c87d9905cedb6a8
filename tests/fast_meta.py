"""Cooperative meta-learning (model.fast_weights()), written once for every strategy and
once as plain single-process PyTorch on the whole batch.

Each meta-step has TASKS tasks. The ranks of a cooperative group adapt one task's fast weights
together, the task's support and query sets split over them; hsdp's replica groups take
different tasks. One process runs every task on its whole sets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import metadist

TASKS, SHOTS = 4, 12  # 4 tasks: split over 1 or 2 groups; 12 shots: over 1, 2, 3 or 4 ranks
INNER_STEPS, INNER_LR = 3, 0.1
META_STEPS = 10
# The Adam-style and clipped inner updates. eps 0.1: at 1e-3 the second-order terms of
# 1 / (sqrt(v) + eps) amplify float32 rounding so much that one process computing its own
# batch in two halves already moves the weights by 4e-4 after 10 meta-steps.
BETAS, EPS, CLIP = (0.9, 0.99), 0.1, 0.5


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # tanh, so second derivatives matter; 7 and 33 wide, so flats split unevenly over 3 ranks
    return nn.Sequential(nn.Linear(3, 33), nn.Tanh(), nn.Linear(33, 7), nn.Tanh(),
                         nn.Linear(7, 2))


def tasks(step: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, ...]]:
    """(x_support, y_support, x_query, y_query) of every task of one meta-step (drawn on
    the CPU, then moved: the same numbers on every device)."""
    g = torch.Generator().manual_seed(500 + step)
    out = []
    for _ in range(TASKS):
        w = torch.randn(3, 2, generator=g)
        x = torch.randn(2 * SHOTS, 3, generator=g)
        y = torch.sin(x @ w)
        out.append(tuple(t.to(device) for t in (x[:SHOTS], y[:SHOTS], x[SHOTS:], y[SHOTS:])))
    return out


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def reference(optimizer: str = "adam", update: str = "sgd", device: torch.device | str = "cpu"
              ) -> dict[str, torch.Tensor]:
    model = net().to(device)
    opt = _optimizer(optimizer, model.parameters())
    for step in range(META_STEPS):
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for xs, ys, xq, yq in tasks(step, device):
            names = [n for n, _ in model.named_parameters()]
            fast = [p for _, p in model.named_parameters()]
            state = _start_state(fast, lambda t: [torch.zeros_like(p) for p in t])
            for _ in range(INNER_STEPS):
                inner = _mse(functional_call(model, dict(zip(names, fast, strict=True)),
                                             (xs,)), ys)
                grads = list(torch.autograd.grad(inner, fast, create_graph=True))
                norm = torch.sqrt(sum((g * g).sum() for g in grads))
                fast, state = _update(update, fast, grads, norm, state, _zip_map)
            fast = dict(zip(names, fast, strict=True))
            total = total + _mse(functional_call(model, fast, (xq,)), yq) / TASKS
        total.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zip_map(fn: Any, *lists: Any) -> list[torch.Tensor]:
    return [fn(*args) for args in zip(*lists, strict=True)]


def _start_state(fast: Any, zeros: Any) -> Any:
    return (zeros(fast), zeros(fast), 0)


def _update(update: str, fast: Any, grads: Any, norm: torch.Tensor, state: Any,
            zip_map: Any) -> tuple[Any, Any]:
    """One inner update, the same arithmetic on lists of full tensors (one process) and on
    fast weights (``zip_map`` applies an element-wise function to matching items)."""
    if update == "sgd":
        return zip_map(lambda p, g: p - INNER_LR * g, fast, grads), state
    if update == "clipped":  # the global norm: one collective on shards
        factor = torch.clamp(CLIP / norm, max=1.0)
        return zip_map(lambda p, g: p - INNER_LR * factor * g, fast, grads), state
    m, v, t = state  # Adam-style, bias-corrected, differentiable
    t += 1
    m = zip_map(lambda m_, g: BETAS[0] * m_ + (1 - BETAS[0]) * g, m, grads)
    v = zip_map(lambda v_, g: BETAS[1] * v_ + (1 - BETAS[1]) * g * g, v, grads)
    c1, c2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
    fast = zip_map(lambda p, m_, v_: p - INNER_LR * (m_ / c1) / ((v_ / c2).sqrt() + EPS),
                   fast, m, v)
    return fast, (m, v, t)


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _slice(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    per = t.shape[0] // count
    return t[index * per:(index + 1) * per]


def on_rank(strategy: str, options: dict[str, Any] | None = None,
            optimizer: str = "adam", update: str = "sgd") -> dict[str, torch.Tensor]:
    """The cooperative program: the same lines under every strategy, on the rank's device."""
    s = metadist.strategy(strategy, **(options or {}))
    model = net()
    model, opt = s.setup(model, _optimizer(optimizer, model.parameters()))
    for step in range(META_STEPS):
        opt.zero_grad()
        start = model.fast_weights()
        device = metadist.world().device
        mine = _slice_tasks(tasks(step, device), start.group_index, start.groups)
        total = torch.zeros((), device=device)
        for task in mine:  # this rank's slice of each set of the task
            xs, ys, xq, yq = (_slice(t, start.group_rank, start.group_size) for t in task)
            fast = start
            state = _start_state(fast, lambda f: f.zeros_like())
            for _ in range(INNER_STEPS):
                inner = _mse(model.functional_forward(fast, xs), ys)
                grads = fast.grad(inner)
                fast, state = _update(update, fast, grads, grads.norm(), state,
                                      lambda fn, first, *rest: first.map(fn, *rest))
            total = total + _mse(model.functional_forward(fast, xq), yq) / len(mine)
        s.backward(total)
        opt.step()
    # by the user's names (activation checkpointing's wrapper adds "checkpointed.")
    return {n.replace("checkpointed.", ""): p.detach().clone()
            for n, p in model.full_parameters().items()}


def _slice_tasks(all_tasks: list[Any], index: int, count: int) -> list[Any]:
    per = len(all_tasks) // count
    return all_tasks[index * per:(index + 1) * per]


# ----- memory: a model whose parameters dominate ---------------------------------------------
WIDTH, DEPTH, BATCH = 192, 6, 8


def wide_net(width: int = WIDTH, depth: int = DEPTH) -> nn.Module:
    """``depth`` Linear(width, width) + tanh layers (one unit each under wrap_classes)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def unit_bytes() -> int:
    """One Linear unit, whole (float32)."""
    return WIDTH * (WIDTH + 1) * 4


def _meta_step(strategy: str, path: str, options: dict[str, Any] | None
               ) -> tuple[Any, Any]:
    """A set-up model's meta-step (K inner steps with create_graph, the outer loss,
    backward) and its optimizer: ``path`` is "sharded" (model.fast_weights()) or "gathered"
    (full_parameters())."""
    s = metadist.strategy(strategy, **(options or {}))
    model = wide_net()
    model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)

    def step() -> None:
        if path == "sharded":
            fast = model.fast_weights()
            xs, ys = (_slice(t, fast.group_rank, fast.group_size) for t in (x, y))
            for _ in range(INNER_STEPS):
                fast = fast - INNER_LR * fast.grad(_mse(model.functional_forward(fast, xs), ys))
        else:
            w = metadist.world()
            xs, ys = (_slice(t, w.rank, w.world_size) for t in (x, y))
            fast = model.full_parameters()
            for _ in range(INNER_STEPS):
                inner = _mse(model.functional_forward(fast, xs), ys)
                grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
                fast = {n: p - INNER_LR * d for (n, p), d in zip(fast.items(), grads,
                                                                 strict=True)}
        s.backward(_mse(model.functional_forward(fast, xs), ys))

    return step, opt


def meta_step_peak(strategy: str, path: str, options: dict[str, Any] | None = None) -> int:
    """Bytes of live storages at the peak of one meta-step, above what was alive before
    it (:func:`_meta_step`)."""
    from metadist.testing import peak_bytes_of

    step, opt = _meta_step(strategy, path, options)
    step()  # the gradients' own storage exists from here on, as in training
    opt.zero_grad(set_to_none=False)
    return peak_bytes_of(step)[1]


def meta_steps_kept(strategy: str, path: str, options: dict[str, Any] | None = None,
                    steps: int = 3) -> int:
    """Bytes of storages that ``steps`` training meta-steps (each with the optimizer's step)
    allocated and left alive: what a long run would accumulate."""
    from metadist.testing import bytes_kept_by

    step, opt = _meta_step(strategy, path, options)

    def train() -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=False)
            step()
            opt.step()

    train()  # the gradients' own storage exists from here on
    return bytes_kept_by(train)[1]


# ----- the TorchOpt drop-in's functional optimisers on fast weights -----------------------------
def torchopt_on_rank(strategy: str, options: dict[str, Any] | None = None
                     ) -> dict[str, torch.Tensor]:
    """The cooperative program with TorchOpt's functional API as the inner optimiser
    (gradient clipping by the global norm, then Adam): fast weights are a pytree."""
    from metadist.compat import torchopt

    s = metadist.strategy(strategy, **(options or {}))
    model = net()
    model, opt = s.setup(model, _optimizer("adam", model.parameters()))
    # eps as in the Adam-style update above (second-order terms of 1 / (sqrt(v) + eps))
    inner_opt = torchopt.chain(torchopt.clip.clip_grad_norm(CLIP), torchopt.adam(0.05, eps=EPS))
    for step in range(META_STEPS):
        opt.zero_grad()
        start = model.fast_weights()
        device = metadist.world().device
        mine = _slice_tasks(tasks(step, device), start.group_index, start.groups)
        total = torch.zeros((), device=device)
        for task in mine:
            xs, ys, xq, yq = (_slice(t, start.group_rank, start.group_size) for t in task)
            fast, state = start, inner_opt.init(start)
            for _ in range(INNER_STEPS):
                grads = fast.grad(_mse(model.functional_forward(fast, xs), ys))
                updates, state = inner_opt.update(grads, state, inplace=False)
                fast = torchopt.apply_updates(fast, updates, inplace=False)
            total = total + _mse(model.functional_forward(fast, xq), yq) / len(mine)
        s.backward(total)
        opt.step()
    return {n: p.detach().clone() for n, p in model.full_parameters().items()}
