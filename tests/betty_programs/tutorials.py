"""Betty 0.2.1's tutorial/1_quick_start.py .. 5_distributed_training.py, ported as one program
that runs on Betty 0.2.1 and on metadist.compat.betty with only the imports changed
(``run(impl, strategy, tutorial=k)``).

The five tutorials build one data-reweighting program step by step; what each adds is kept
and selected by ``tutorial``:

1. quick start: a ``Reweight`` upper problem (an MLP 1-100-1 with a sigmoid, Adam lr 1e-5)
   weighting each sample's loss of a ``Classifier`` lower problem (Flatten, MLP 784-200-10,
   SGD lr 0.1 momentum 0.9, MultiStepLR at 1/2 and 5/6 of the run, ``Config(type="darts",
   unroll_steps=1)``) on an imbalanced MNIST-shaped dataset; modules, optimizers, scheduler
   and loaders handed to the problems' constructors; ``BASELINE`` (``baseline=True``) trains
   the classifier alone (``problems = [classifier]``, empty dependencies); after
   ``engine.run()`` the program scores ``classifier(x)`` over the validation loader itself.
2. validation: a ``ReweightingEngine`` whose ``validation()`` (under ``torch.no_grad``)
   scores ``self.classifier(x)`` on ``self.device`` and keeps ``self.best_acc``, every
   ``valid_step`` iterations.
3. logging: the reweight problem's ``training_step`` returns ``{"loss": ..., "acc": ...}``
   (``acc`` through ``.item()``) and logs every ``log_step``.
4. memory optimisation: CIFAR-shaped data, a Bottleneck ResNet classifier (SGD lr 0.01) and
   ``precision`` on both problems' Configs.
5. distributed training: as 4, ``EngineConfig(strategy=...)`` from the command line and
   batches of 50 for the classifier and validation (100 for the reweighting).

Shrunk: 600 MNIST-shaped (1x28x28) or CIFAR-shaped (3x32x32) samples drawn from a private
generator (no download; the class imbalance of ``build_dataset`` kept: ``reweight_size``
100, ``imbalanced_factor`` 100), batch sizes divided by 5 (100 -> 20, 50 -> 10), 12
iterations (not 3000/10000; the milestones and ``valid_step`` scaled with them), the ResNet
of one Bottleneck per stage at 1/8 of the width (tutorials 4 and 5 use ResNet50), float64,
no data augmentation (torchvision's random crops and flips). ``precision`` is "fp32": Betty's
"fp16" on the CPU is CUDA's autocast and GradScaler, which turn themselves off there, so
Betty computes float64 either way. Tutorial 4's ``EngineConfig(distributed=True)`` is
dropped: Betty 0.2.1's EngineConfig has no such field (tutorial 5's ``strategy`` replaced it).

Recorded beside the states: each problem's logged losses (rank 0; through ``log``), the
validations, tutorial 1's final accuracy. ``upper_sgd`` puts the reweighting on plain SGD
(lr 0.1: Adam at lr 1e-5 would hide a wrong hypergradient scale). On N ranks each loader's
``batch_size`` is the global batch / N, as in the suite's other ports.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from betty_programs.ported import api, engine_config, learning_rates, place, snapshot

NUM_SAMPLES, NUM_CLASSES = 600, 10
TRAIN_ITERS = 12
SHRINK = 5  # batch sizes: the original's / SHRINK


def build_dataset(shape: tuple[int, ...], reweight_size: int = 100,
                  imbalanced_factor: int = 100) -> tuple[TensorDataset, TensorDataset]:
    """The tutorials' ``build_dataset``: ``reweight_size / classes`` samples of each class
    for the reweighting, the rest of each class cut to an imbalanced count for the
    classifier (class c keeps ``sample_num / factor ** (c / 9)``, the counts shuffled)."""
    g = torch.Generator().manual_seed(0)
    targets = torch.arange(NUM_SAMPLES) % NUM_CLASSES
    images = _images(targets, shape, g)
    num_meta = reweight_size // NUM_CLASSES
    sample_num = (NUM_SAMPLES - reweight_size) // NUM_CLASSES
    imbalanced = [int(sample_num / imbalanced_factor ** (c / (NUM_CLASSES - 1)))
                  for c in range(NUM_CLASSES)]
    imbalanced = [imbalanced[i] for i in torch.randperm(NUM_CLASSES, generator=g)]
    to_meta: list[int] = []
    to_train: list[int] = []
    for c in range(NUM_CLASSES):
        members = (targets == c).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=g)].tolist()
        to_meta += members[:num_meta]
        to_train += members[num_meta:][:imbalanced[c]]
    return (TensorDataset(images[to_train], targets[to_train]),
            TensorDataset(images[to_meta], targets[to_meta]))


def valid_dataset(shape: tuple[int, ...]) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    targets = torch.arange(100) % NUM_CLASSES
    return TensorDataset(_images(targets, shape, g), targets)


def _images(targets: torch.Tensor, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Noise around one fixed pattern per class (the same patterns in every split), so the
    classes can be learnt and the validations' accuracies move."""
    patterns = torch.randn(NUM_CLASSES, *shape, generator=torch.Generator().manual_seed(2),
                           dtype=torch.float64)
    noise = torch.randn(len(targets), *shape, generator=g, dtype=torch.float64)
    return patterns[targets] + 2 * noise


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1,
                               bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, self.expansion * planes, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(self.expansion * planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != self.expansion * planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, self.expansion * planes, kernel_size=1, stride=stride,
                          bias=False),
                nn.BatchNorm2d(self.expansion * planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += self.shortcut(x)
        return F.relu(out)


class ResNet(nn.Module):
    def __init__(self, block: type[Bottleneck], num_blocks: list[int], num_classes: int = 10,
                 width: int = 64) -> None:
        super().__init__()
        self.in_planes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(block, width, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(block, 2 * width, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, num_blocks[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, num_blocks[3], stride=2)
        self.linear = nn.Linear(8 * width * block.expansion, num_classes)

    def _make_layer(self, block: type[Bottleneck], planes: int, num_blocks: int,
                    stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (num_blocks - 1):
            layers.append(block(self.in_planes, planes, s))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, 4)
        return self.linear(out.view(out.size(0), -1))


def run(impl: str, strategy: str = "default", tutorial: int = 2, baseline: bool = False,
        upper_sgd: bool = False) -> dict[str, Any]:
    """Tutorial ``tutorial`` (1-5) for TRAIN_ITERS iterations."""
    b = api(impl)
    world, _ = place()
    cifar = tutorial >= 4
    losses: list[tuple[str, int, float]] = []
    validations: list[dict[str, float]] = []

    torch.manual_seed(0)
    shape = (3, 32, 32) if cifar else (1, 28, 28)
    classifier_dataset, reweight_dataset = build_dataset(shape)
    valid_batch = 50 if tutorial == 5 else 100
    valid_dataloader = DataLoader(valid_dataset(shape), batch_size=valid_batch // SHRINK // world)
    precision = "fp32"  # the tutorials' "fp16" is CUDA's: off on the CPU (docstring)

    def logged(problem: Any, stats: dict[str, Any]) -> None:
        losses.append((problem.name, problem.count, float(stats["loss"])))

    reweight_dataloader = DataLoader(reweight_dataset, batch_size=100 // SHRINK // world,
                                     shuffle=True)
    reweight_module = nn.Sequential(nn.Linear(1, 100), nn.ReLU(), nn.Linear(100, 1),
                                    nn.Sigmoid()).double()
    reweight_optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(reweight_module.parameters(), lr=0.1) if upper_sgd
        else torch.optim.Adam(reweight_module.parameters(), lr=1e-5))

    class Reweight(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> Any:
            inputs, labels = batch
            outputs = self.classifier(inputs)
            loss = F.cross_entropy(outputs, labels.long())
            if tutorial < 3:
                return loss
            acc = (outputs.argmax(dim=1) == labels.long()).float().mean().item() * 100
            return {"loss": loss, "acc": acc}

        def log(self, stats: dict[str, Any], global_step: Any) -> None:
            logged(self, stats)

    reweight_config = (b.Config() if tutorial < 3
                       else b.Config(log_step=2, precision=precision))
    reweight = Reweight(name="reweight", module=reweight_module, optimizer=reweight_optimizer,
                        train_data_loader=reweight_dataloader, config=reweight_config)

    classifier_batch = 50 if tutorial == 5 else 100
    classifier_dataloader = DataLoader(classifier_dataset,
                                       batch_size=classifier_batch // SHRINK // world,
                                       shuffle=True)
    classifier_module: nn.Module
    if cifar:
        classifier_module = ResNet(Bottleneck, [1, 1, 1, 1], width=8).double()
        lr, milestones = 0.01, [TRAIN_ITERS * 6 // 10, TRAIN_ITERS * 17 // 20]
    else:
        classifier_module = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(),
                                          nn.Linear(200, 10)).double()
        lr, milestones = 0.1, [TRAIN_ITERS // 2, TRAIN_ITERS * 5 // 6]
    classifier_optimizer = torch.optim.SGD(classifier_module.parameters(), lr=lr, momentum=0.9)
    classifier_scheduler = torch.optim.lr_scheduler.MultiStepLR(
        classifier_optimizer, milestones=milestones, gamma=0.1)

    class Classifier(b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, labels = batch
            outputs = self.module(inputs)
            loss = F.cross_entropy(outputs, labels.long(), reduction="none")
            if baseline:
                return torch.mean(loss)
            loss_reshape = torch.reshape(loss, (-1, 1))
            weight = self.reweight(loss_reshape.detach())
            return torch.mean(weight * loss_reshape)

    classifier_config = (b.Config(type="darts", unroll_steps=1) if tutorial < 4
                         else b.Config(type="darts", unroll_steps=1, precision=precision))
    classifier = Classifier(name="classifier", module=classifier_module,
                            optimizer=classifier_optimizer, scheduler=classifier_scheduler,
                            train_data_loader=classifier_dataloader, config=classifier_config)

    class ReweightingEngine(b.Engine):  # type: ignore[misc,name-defined]
        @torch.no_grad()
        def validation(self) -> dict[str, float]:
            correct = 0
            total = 0
            if not hasattr(self, "best_acc"):
                self.best_acc = -1
            for x, target in valid_dataloader:
                x, target = x.to(self.device), target.to(self.device)  # noqa: PLW2901
                out = self.classifier(x)
                correct += (out.argmax(dim=1) == target).sum().item()
                total += x.size(0)
            acc = correct / total * 100
            if self.best_acc < acc:  # noqa: PLR1730 (the tutorial's text)
                self.best_acc = acc
            validations.append({"acc": acc, "best_acc": self.best_acc})
            return {"acc": acc, "best_acc": self.best_acc}

    fields: dict[str, Any] = {"train_iters": TRAIN_ITERS}
    if tutorial >= 2:
        fields["valid_step"] = TRAIN_ITERS // 3
    config = engine_config(b, impl, strategy, batchnorm=cifar, **fields)
    problems = [classifier] if baseline else [reweight, classifier]
    dependencies: dict[str, dict[Any, list[Any]]] = (
        {"l2u": {}, "u2l": {}} if baseline
        else {"l2u": {classifier: [reweight]}, "u2l": {reweight: [classifier]}})
    engine_class = b.Engine if tutorial == 1 else ReweightingEngine
    initial = snapshot(problems)
    engine = engine_class(config=config, problems=problems, dependencies=dependencies)
    engine.run()
    out = {"initial": initial, "final": snapshot(problems), "losses": losses,
           "validations": validations, "lr": learning_rates(problems),
           "counts": {p.name: p.count for p in problems}}
    if tutorial == 1:  # the quick start scores the trained classifier itself
        correct = total = 0
        for x, target in valid_dataloader:
            correct += int((classifier(x).argmax(dim=1) == target).sum().item())
            total += x.size(0)
        out["accuracy"] = correct / total * 100
    return out
