"""Betty 0.2.1's examples/saliency_aware_nas_4_level (SANAS: train_search_sanas.py with
model_search.py, operations.py, genotypes.py and utils.py's CIFAR transforms), ported to run
on Betty 0.2.1 and on metadist.compat.betty with only the imports changed (``run(impl, ...)``).

What is the original's, kept:

* Its four levels in three problems: ``inner1`` trains a DARTS search network on clean
  images; ``inner2``'s ``attack`` derives saliency from inner1 (a uniform random start in
  the epsilon ball, then signed-gradient steps on ``self.inner1.module``, clamped to the
  ball and to [0, 1]) and ``inner2`` trains a second search network on the reweighted
  images ``x * delta`` (``loss2 + gamma * loss1``, loss1 inner1's on the same images);
  ``outer`` scores both networks on held-out images (``loss2 + lam * loss1``, asserted not
  NaN) and trains the architecture.
* Dependencies ``l2u = {inner1: [inner2, outer], inner2: [outer]}``,
  ``u2l = {outer: [inner2, inner1]}``, problems listed [outer, inner2, inner1]; the Configs
  as written (inners ``type="darts", allow_unused=True``, outer ``retain_graph=True,
  first_order=True, log_step=1``); ``EngineConfig(roll_back=True)``: after each outer step
  both inners return to their window's start and retake it, inner2 re-running its attack
  (6 attacks an iteration: the step, 4 in darts' finite differences, the retake).
* Everything built by the ``configure_*`` hooks: Architecture on Adam (betas (0.5, 0.999),
  weight decay), each Network on SGD (momentum, weight decay) with a CosineAnnealingLR over
  ``train_iters // unroll_steps`` to 0; the inners' loaders on the first ``train_portion``
  of the training set, outer's on the rest, each its own SubsetRandomSampler;
  ``train_iters`` by the original's formula. ``NASEngine.validation`` (eval mode, rank 0):
  test accuracy and genotype, recorded instead of logged and saved; it returns nothing.
* DARTS' search space (``--darts_type DARTS``; the PC-DARTS default is not ported): its
  ``Network`` and ``Architecture`` are betty_programs.nas's, the same model. SANAS' copy
  orders the alpha pair (normal, reduce), the NAS example's (reduce, normal): a naming
  inside the pair; the same parameters, drawn in the same order, reach the same cells.

Shrunk or replaced: 3 cells of one node (multiplier 1; the original's 8 cells of 4, and a
run's time goes with the number of operations: 2 nodes tripled it), 4 initial channels, 4
classes; 2 attack steps (7); 8x8 synthetic images (uniform pixels, then utils.py's CIFAR-100
normalisation, without its random crop and flip), 32 training and 16 test samples from a
private generator, global batch 8: one epoch is 3 iterations (16 // 8 + 1, the loaders
start a second epoch at the 3rd); ``valid_step`` 2 (once an epoch in the original), so
training goes on after a validation. float64. Betty 0.2.1's problems take no ``device=``
(the original passes one; the engine places them); the per-step print, ``num_workers`` and
``pin_memory`` are dropped. On N ranks the loaders' ``batch_size`` is ``GLOBAL_BATCH // N``
and the attack draws its random start for the global batch, each rank taking its rows: N
ranks draw what one process draws, given that their global generators agree.

``upper_sgd=True`` puts outer on plain SGD (Adam's normalisation hides a wrongly scaled
hypergradient); lr 1e-3, as the hypergradient is large (darts' two evaluations of inner2
attack from two random starts, their difference divided by 2 eps).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from betty_programs.nas import Architecture, Network
from betty_programs.ported import api, engine_config, learning_rates, place, snapshot

TRAIN_SAMPLES, TEST_SAMPLES, CLASSES, SIDE, GLOBAL_BATCH = 32, 16, 4, 8, 8
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)
ARGS = dict(lr=0.1, lr_min=0.0, momentum=0.9, wd=3e-4, epochs=1, init_ch=4, layers=3,
            train_portion=0.5, arch_lr=6e-4, arch_wd=1e-3, arch_steps=1, multiplier=1,
            unroll_steps=1, lam=1.0, gamma=1.0, valid_step=2, upper_sgd_lr=1e-3,
            rand=True, num_steps=2, epsilon=8 / 255.0, step_size=2 / 255.0)  # last 4: attack


def cifar_like() -> tuple[TensorDataset, TensorDataset]:
    """Training and test sets: pixels in [0, 1] normalised as utils.py's transforms do; the
    class is the quadrant with the brightest mean; from a private generator."""
    g = torch.Generator().manual_seed(0)
    mean = torch.tensor(CIFAR100_MEAN, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(CIFAR100_STD, dtype=torch.float64).view(3, 1, 1)

    def images(n: int) -> TensorDataset:
        pixels = torch.rand(n, 3, SIDE, SIDE, generator=g, dtype=torch.float64)
        brightness = F.avg_pool2d(pixels.mean(1, keepdim=True), SIDE // 2).flatten(1)
        return TensorDataset((pixels - mean) / std, brightness.argmax(1))

    return images(TRAIN_SAMPLES), images(TEST_SAMPLES)


def random_start(x: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The attack's uniform start in the epsilon ball, drawn for the global batch from the
    global generator (one process: ``zeros_like(x).uniform_``); this rank's rows of it."""
    world, rank = place()
    noise = x.new_zeros((world * len(x), *x.shape[1:])).uniform_(-epsilon, epsilon)
    return noise[rank * len(x):(rank + 1) * len(x)]


def run(impl: str, strategy: str = "default", upper_sgd: bool = False,
        **overrides: Any) -> dict[str, Any]:
    """Search for ``train_iters`` iterations; the problems' initial and final states (with
    the BatchNorm statistics), outer's logged losses, inner2's step count at each attack,
    the validation records (rank 0) and the final learning rates."""
    b = api(impl)
    args = {**ARGS, **overrides}
    world, _ = place()
    batch = GLOBAL_BATCH // world
    losses: list[tuple[str, int, float]] = []
    validations: list[tuple[int, float, dict[str, Any]]] = []
    attacks: list[int] = []

    torch.manual_seed(0)  # the original's generator state is whatever it is at this point
    train_data, valid_data = cifar_like()
    test_queue = DataLoader(valid_data, batch_size=batch, shuffle=False)
    num_train = len(train_data)
    indices = list(range(num_train))
    split = math.floor(args["train_portion"] * num_train)
    train_iters = int(args["epochs"] * (num_train * args["train_portion"] // GLOBAL_BATCH + 1)
                      * args["unroll_steps"])

    def queue(subset: list[int]) -> DataLoader[Any]:
        return DataLoader(train_data, batch_size=batch, sampler=SubsetRandomSampler(subset))

    class Logged:
        def log(self, stats: dict[str, Any], global_step: Any) -> None:
            losses.append((self.name, self.count, float(stats["loss"])))

    class Outer(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def forward(self) -> Any:
            return self.module()

        def training_step(self, batch: Any) -> torch.Tensor:
            x, target = batch
            alphas = self.forward()
            loss1 = self.inner1.module.loss(x, alphas, target)
            loss2 = self.inner2.module.loss(x, alphas, target)
            loss = loss2 + args["lam"] * loss1
            assert not math.isnan(loss.item())
            return loss

        def configure_train_data_loader(self) -> DataLoader[Any]:
            return queue(indices[split:])  # valid_queue

        def configure_module(self) -> nn.Module:
            return Architecture(steps=args["arch_steps"]).double()

        def configure_optimizer(self) -> torch.optim.Optimizer:
            if upper_sgd:
                return torch.optim.SGD(self.module.parameters(), lr=args["upper_sgd_lr"])
            return torch.optim.Adam(self.module.parameters(), lr=args["arch_lr"],
                                    betas=(0.5, 0.999), weight_decay=args["arch_wd"])

    class SearchNetwork(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        """Inner1's and Inner2's identical hooks (written out twice in the original)."""

        def configure_train_data_loader(self) -> DataLoader[Any]:
            return queue(indices[:split])  # train_queue

        def configure_module(self) -> nn.Module:
            criterion = nn.CrossEntropyLoss()
            return Network(args["init_ch"], CLASSES, args["layers"], criterion,
                           steps=args["arch_steps"], multiplier=args["multiplier"]).double()

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.module.parameters(), lr=args["lr"],
                                   momentum=args["momentum"], weight_decay=args["wd"])

        def configure_scheduler(self) -> Any:
            return torch.optim.lr_scheduler.CosineAnnealingLR(
                self.optimizer, float(train_iters // args["unroll_steps"]),
                eta_min=args["lr_min"])

    class Inner2(SearchNetwork):
        def forward(self, pert_inp: torch.Tensor, alphas: Any) -> torch.Tensor:
            return self.module(pert_inp, alphas)

        def training_step(self, batch: Any) -> torch.Tensor:
            x, target = batch
            alphas = self.outer()
            pert_inp = self.attack(alphas, x, target)
            loss1 = self.inner1.module.loss(pert_inp, alphas, target)
            loss2 = self.module.loss(pert_inp, alphas, target)
            return loss2 + args["gamma"] * loss1

        def attack(self, alphas: Any, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            """Saliency: the perturbation that raises inner1's loss most, as a pixel weight."""
            attacks.append(self.count)
            x_purt = x.clone().detach()
            target = target.clone().detach()
            epsilon, step_size = args["epsilon"], args["step_size"]
            if args["rand"]:
                x_purt = x_purt + random_start(x_purt, epsilon)
            for _ in range(args["num_steps"]):
                x_purt.requires_grad_()
                with torch.enable_grad():
                    logits = self.inner1.module(x_purt, alphas)
                    loss1 = torch.mean(F.cross_entropy(logits, target, reduction="none"))
                grad = torch.autograd.grad(loss1, [x_purt])[0]
                x_purt = x_purt.detach() + step_size * torch.sign(grad.detach())
                delta = torch.clamp(x_purt - x, min=-epsilon, max=epsilon)
                x_purt = torch.clamp(x + delta, min=0, max=1).detach()
            return torch.mul(x, delta)

    class Inner1(SearchNetwork):
        def forward(self, x: torch.Tensor, alphas: Any) -> torch.Tensor:
            return self.module(x, alphas)

        def training_step(self, batch: Any) -> torch.Tensor:
            x, target = batch
            alphas = self.outer()
            return self.module.loss(x, alphas, target)

    class NASEngine(b.Engine):  # type: ignore[misc,name-defined]
        @torch.no_grad()
        def validation(self) -> None:
            corrects, total = 0.0, 0
            for x, target in test_queue:
                alphas = self.outer()
                _, correct = self.inner1.module.loss(x, alphas, target, acc=True)
                corrects += correct
                total += x.size(0)
            genotype = self.inner1.module.genotype(self.outer())
            validations.append((self.global_step, corrects / total, genotype._asdict()))

    outer_config = b.Config(retain_graph=True, first_order=True, log_step=1)
    inner2_config = b.Config(type="darts", unroll_steps=args["unroll_steps"],
                             allow_unused=True)
    inner1_config = b.Config(type="darts", unroll_steps=args["unroll_steps"],
                             allow_unused=True)
    config = engine_config(b, impl, strategy, batchnorm=True, valid_step=args["valid_step"],
                           train_iters=train_iters, roll_back=True)
    outer = Outer(name="outer", config=outer_config)
    inner1 = Inner1(name="inner1", config=inner1_config)
    inner2 = Inner2(name="inner2", config=inner2_config)
    problems = [outer, inner2, inner1]
    dependencies = {"l2u": {inner1: [inner2, outer], inner2: [outer]},
                    "u2l": {outer: [inner2, inner1]}}
    engine = NASEngine(config=config, problems=problems, dependencies=dependencies)
    initial = snapshot(problems)
    engine.run()
    return {"initial": initial, "final": snapshot(problems), "losses": losses,
            "validations": validations, "attacks": attacks, "lr": learning_rates(problems),
            "counts": {p.name: p.count for p in problems}, "train_iters": train_iters}
