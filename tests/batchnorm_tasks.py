"""Meta-learning programs whose network has BatchNorm, in the peers' and metadist's idioms, for
tests/test_task_batchnorm.py: Omniglot's shapes (1 x 28 x 28 images, 5 ways, synthetic), a
small convolutional net with a BatchNorm after each convolution (learn2learn's OmniglotCNN in
miniature), second-order MAML and its relatives.

In one process every task's batch is normalised by that task's statistics, and each task's
forwards update the running statistics in turn. Each body runs OUTER_STEPS meta-steps on this
rank's contiguous slice of the meta-batch (one process: every task, in order) and returns the
parameters and buffers by the user's module's names, or the message of the error it raised
(every rank raises at the same point: the errors tested are decided before any collective).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import metadist
import peers

WAYS, SHOTS, QUERIES = 5, 2, 2
TASKS = 6  # divisible by 1, 2 and 3 ranks
OUTER_STEPS = 10
# rates at which float32 rounding stays at its own size over OUTER_STEPS (larger ones, with a
# BatchNorm over 5 samples, amplify it 100-fold a step: no parity test could tell anything)
INNER_LR, OUTER_LR = 0.1, 0.01
CHANNELS = 6

State = dict[str, Tensor]
Task = tuple[Tensor, Tensor, Tensor, Tensor]


def omniglot_net() -> nn.Module:
    """Two conv blocks (conv 3x3 of stride 2, BatchNorm, ReLU: OmniglotCNN's, which has no
    max-pool) and a linear head."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for c_in in (1, CHANNELS):
        blocks += [nn.Conv2d(c_in, CHANNELS, 3, stride=2, padding=1),
                   nn.BatchNorm2d(CHANNELS), nn.ReLU()]
    return nn.Sequential(nn.Sequential(*blocks), nn.Flatten(),
                         nn.Linear(CHANNELS * 7 * 7, WAYS))


def meta_batch(step: int) -> list[Task]:
    """TASKS synthetic 5-way 1-shot tasks: (support x, support y, query x, query y)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(TASKS):
        prototypes = torch.randn(WAYS, 1, 28, 28, generator=g)
        task: list[Tensor] = []
        for n in (SHOTS, QUERIES):
            y = torch.arange(WAYS).repeat_interleave(n)
            task += [prototypes[y] + 0.5 * torch.randn(len(y), 1, 28, 28, generator=g), y]
        out.append((task[0], task[1], task[2], task[3]))
    return out


def state_of(module: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ----- one meta-step's loss, each idiom -----------------------------------------------------

def l2l_maml(maml: Any, tasks: list[Task]) -> Tensor:
    """learn2learn: a clone per task, one adapt step, the mean query loss."""
    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        learner = maml.clone()
        learner.adapt(F.cross_entropy(learner(xs), ys))
        total = total + F.cross_entropy(learner(xq), yq)
    return total / len(tasks)


def anil(features: Callable[[Tensor], Tensor], head: Any, tasks: list[Task]) -> Tensor:
    """learn2learn's ANIL: the body run on each task's batch, only the head adapted."""
    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        learner = head.clone()
        learner.adapt(F.cross_entropy(learner(features(xs)), ys))  # type: ignore
        total = total + F.cross_entropy(learner(features(xq)), yq)
    return total / len(tasks)


def higher_maml(model: nn.Module, tasks: list[Task]) -> Tensor:
    """higher: innerloop_ctx on the model's own weights, one differentiable SGD step."""
    import higher

    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        with higher.innerloop_ctx(model, inner, copy_initial_weights=False) as (fmodel, opt):
            opt.step(F.cross_entropy(fmodel(xs), ys))
            total = total + F.cross_entropy(fmodel(xq), yq)
    return total / len(tasks)


def functional_maml(forward: Callable[[dict[str, Tensor], Tensor], Tensor],
                    params: dict[str, Tensor], tasks: list[Task]) -> Tensor:
    """The docs' form: ``full_parameters()`` adapted with autograd.grad, run functionally."""
    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        grads = torch.autograd.grad(F.cross_entropy(forward(params, xs), ys),
                                    list(params.values()), create_graph=True)
        fast = {n: p - INNER_LR * g for (n, p), g in zip(params.items(), grads, strict=True)}
        total = total + F.cross_entropy(forward(fast, xq), yq)
    return total / len(tasks)


def clone_maml(model: nn.Module, tasks: list[Task]) -> Tensor:
    """The portable form: ``module_clone(model, by="copy")`` stepped by ``MetaSGD``."""
    from metadist.meta import MetaSGD, module_clone

    total = torch.zeros(())
    for xs, ys, xq, yq in tasks:
        clone = module_clone(model, by="copy")
        MetaSGD(clone, lr=INNER_LR).step(F.cross_entropy(clone(xs), ys))
        total = total + F.cross_entropy(clone(xq), yq)
    return total / len(tasks)


# ----- the programs: on the plain net (one process) or the set-up model ---------------------

def _l2l() -> Any:
    peers.use(torchvision_standin=True)
    import learn2learn

    return learn2learn


def _program(name: str, net: nn.Module, model: nn.Module | None
             ) -> tuple[nn.Module, Callable[[list[Task]], Tensor]]:
    """(the module the optimizer steps, its meta-step loss) for ``name``: on ``model`` (the
    set-up model) where given, else on the plain ``net``."""
    m = net if model is None else model
    if name == "learn2learn MAML":
        maml = _l2l().algorithms.MAML(m, lr=INNER_LR, first_order=False)
        return m, lambda tasks: l2l_maml(maml, tasks)
    if name == "learn2learn MetaSGD":  # its learning rates are trained: set up with it
        return m, lambda tasks: l2l_maml(m, tasks)
    if name == "learn2learn ANIL":
        head = _l2l().algorithms.MAML(m[2], lr=INNER_LR, first_order=False)
        body = m[0] if model is None else model.module[0]
        return m, lambda tasks: anil(lambda x: body(x).flatten(1), head, tasks)
    if name == "higher":
        peers.use()
        return m, lambda tasks: higher_maml(m, tasks)
    if name == "full_parameters":
        if model is None:
            def forward(p: dict[str, Tensor], x: Tensor) -> Tensor:
                return torch.func.functional_call(net, p, (x,))
            return m, lambda tasks: functional_maml(forward, dict(net.named_parameters()),
                                                    tasks)
        return m, lambda tasks: functional_maml(model.functional_forward,  # type: ignore
                                                model.full_parameters(), tasks)  # type: ignore
    if name == "module_clone":
        return m, lambda tasks: clone_maml(m, tasks)
    raise ValueError(name)


PROGRAMS = ("learn2learn MAML", "learn2learn MetaSGD", "learn2learn ANIL", "higher",
            "full_parameters", "module_clone")


def _net_for(name: str) -> nn.Module:
    net = omniglot_net()
    if name == "learn2learn MetaSGD":
        return _l2l().algorithms.MetaSGD(net, lr=INNER_LR, first_order=False)
    return net


def one_process(name: str) -> State:
    """Every task of every meta-step, in order, in one plain process."""
    torch.set_num_threads(1)
    net = _net_for(name)
    stepped, loss_of = _program(name, net, None)
    opt = torch.optim.SGD(stepped.parameters(), lr=OUTER_LR)
    for step in range(OUTER_STEPS):
        opt.zero_grad()
        loss_of(meta_batch(step)).backward()
        opt.step()
    return state_of(net)


def on_rank(name: str, strategy: str, options: dict[str, Any]) -> State | str:
    """This rank's contiguous slice of every meta-batch, through ``strategy``."""
    w = metadist.world()
    net = _net_for(name)
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=OUTER_LR))
    per = TASKS // w.world_size
    try:
        _, loss_of = _program(name, net, model)
        for step in range(OUTER_STEPS):
            opt.zero_grad()
            loss_of(meta_batch(step)[w.rank * per:(w.rank + 1) * per]).backward()
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    return state_of(model)


def all_on_rank(strategy: str, options: dict[str, Any], names: tuple[str, ...]
                ) -> dict[str, State | str]:
    return {name: on_rank(name, strategy, options) for name in names}


def all_one_process(names: tuple[str, ...]) -> dict[str, State]:
    return {name: one_process(name) for name in names}
