"""Betty 0.2.1's examples/neural_architecture_search (DARTS search: train_search.py with
model_search.py and operations.py), ported to run on Betty 0.2.1 and on
metadist.compat.betty with only the imports changed (``run(impl, ...)``).

What is the original's, kept:

* ``Architecture``: a module whose forward returns the architecture weights (alphas of the
  reduction and of the normal cells), drawn ``randn * 1e-3``; the ``Arch`` upper problem
  trains it with Adam (betas (0.5, 0.999), weight decay) and its ``training_step`` reaches
  the classifier through a *method of the user's module*:
  ``self.classifier.module.loss(x, self.forward(), target)``.
* ``Network`` / ``Cell`` / ``MixedLayer`` and the eight operations of DARTS' search space
  (none, max/avg pool followed by BatchNorm(affine=False), skip (FactorizedReduce at stride
  2), separable and dilated 3x3/5x5 convolutions, all BatchNorms affine=False), the cells'
  preprocessing (ReLUConvBN, FactorizedReduce after a reduction), reduction cells at 1/3
  and 2/3 of the depth sharing one alpha and the normal cells the other; ``Network.loss``
  (criterion of the logits, optionally the number of correct predictions) and
  ``Network.genotype``.
* ``Classifier`` lower problem: ``self.module.loss(x, self.arch(), target)``; SGD with
  momentum and weight decay and a CosineAnnealingLR over ``train_iters // unroll_steps``;
  ``Config(type="darts", unroll_steps=1)``; the upper ``Config(retain_graph=True)``;
  ``EngineConfig(roll_back=True)``: after each Arch step the classifier returns to its
  state before the step (parameters, BatchNorm statistics, momentum) and retakes it with
  the new alphas on the same batch, stepping its scheduler there.
* Both loaders read one dataset through SubsetRandomSampler (first portion for the
  classifier, the rest for the architecture), shuffled by the global generator as in the
  original (which seeds nothing itself: ``run`` seeds once at its top); ``train_iters`` is
  the original's formula, ``epochs * (num_train * portion // batch + 1) * unroll_steps``.
* The original's work order: Architecture, its optimizer and loader, the Network, its
  optimizer, scheduler and loader, then the problems and the engine.

Shrunk (the brief's "a handful" of everything): 3 cells (a normal cell, then two reduction
cells, so both alphas are used) of 2 nodes, multiplier 2, 4 initial channels, 4 classes,
8x8 synthetic inputs (48 samples from a private generator: no global draw), global batch 8,
one epoch (4 iterations: the architecture steps 4 times, the classifier's loader starts a
second epoch at the 4th). Everything in float64. ``num_workers``/``pin_memory`` are
dropped (worker processes; pinning is CUDA's).

``NASEngine.validation`` is kept in spirit: every ``valid_step`` iterations (in eval mode)
it records the accuracy over the held-out samples and the genotype, instead of saving the
genotype to a file.

On N ranks each loader's ``batch_size`` is ``GLOBAL_BATCH // N`` (Betty's batch size is per
rank). Betty 0.2.1 itself only runs here in one process (its distributed strategies need
CUDA); it needed no change to the program.
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from betty_programs.ported import api, engine_config, learning_rates, place, snapshot

PRIMITIVES = ["none", "max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3",
              "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5"]
Genotype = namedtuple("Genotype", "normal normal_concat reduce reduce_concat")

NUM_SAMPLES, CLASSES, SIDE, GLOBAL_BATCH = 48, 4, 8, 8
HPARAMS = dict(lr=0.025, lr_min=0.001, momentum=0.9, wd=3e-4, epochs=1, init_ch=4, layers=3,
               train_portion=0.5, arch_lr=3e-4, arch_wd=1e-3, arch_steps=2, multiplier=2,
               stem_multiplier=3, unroll_steps=1, report_freq=2)


# ----- operations (operations.py) -------------------------------------------------------------
class ReLUConvBN(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int,
                 affine: bool = True) -> None:
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(c_out, affine=affine))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class DilConv(nn.Module):
    """ReLU, dilated depthwise convolution, pointwise convolution, BatchNorm."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int,
                 dilation: int, affine: bool = True) -> None:
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_in, kernel, stride=stride, padding=padding, dilation=dilation,
                      groups=c_in, bias=False),
            nn.Conv2d(c_in, c_out, 1, padding=0, bias=False),
            nn.BatchNorm2d(c_out, affine=affine))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class SepConv(nn.Module):
    """Two rounds of ReLU, depthwise convolution, pointwise convolution, BatchNorm (the first
    carries the stride)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int,
                 affine: bool = True) -> None:
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_in, kernel, stride=stride, padding=padding, groups=c_in,
                      bias=False),
            nn.Conv2d(c_in, c_in, 1, padding=0, bias=False),
            nn.BatchNorm2d(c_in, affine=affine),
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_in, kernel, stride=1, padding=padding, groups=c_in, bias=False),
            nn.Conv2d(c_in, c_out, 1, padding=0, bias=False),
            nn.BatchNorm2d(c_out, affine=affine))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Zero(nn.Module):
    """The "none" operation: zeros of the (strided) input's shape."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            return x.mul(0.0)
        return x[:, :, ::self.stride, ::self.stride].mul(0.0)


class FactorizedReduce(nn.Module):
    """Halve height and width: two strided 1x1 convolutions, the second shifted by one
    pixel, concatenated along channels, then BatchNorm."""

    def __init__(self, c_in: int, c_out: int, affine: bool = True) -> None:
        super().__init__()
        assert c_out % 2 == 0
        self.relu = nn.ReLU(inplace=False)
        self.conv_1 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, padding=0, bias=False)
        self.conv_2 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, padding=0, bias=False)
        self.bn = nn.BatchNorm2d(c_out, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        return self.bn(torch.cat([self.conv_1(x), self.conv_2(x[:, :, 1:, 1:])], dim=1))


def make_op(primitive: str, c: int, stride: int, affine: bool) -> nn.Module:
    if primitive == "none":
        return Zero(stride)
    if primitive == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if primitive == "max_pool_3x3":
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if primitive == "skip_connect":
        return Identity() if stride == 1 else FactorizedReduce(c, c, affine=affine)
    kernel = int(primitive[-1])
    if primitive.startswith("sep_conv"):
        return SepConv(c, c, kernel, stride, kernel // 2, affine=affine)
    if primitive.startswith("dil_conv"):
        return DilConv(c, c, kernel, stride, kernel - 1, 2, affine=affine)
    raise ValueError(primitive)


# ----- the search network (model_search.py) ------------------------------------------------
class MixedLayer(nn.Module):
    """Every primitive on one edge; the output is their sum weighted by the edge's alphas."""

    def __init__(self, c: int, stride: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for primitive in PRIMITIVES:
            op = make_op(primitive, c, stride, False)
            if "pool" in primitive:  # pools get a BatchNorm without affine parameters
                op = nn.Sequential(op, nn.BatchNorm2d(c, affine=False))
            self.layers.append(op)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return sum(w * op(x) for w, op in zip(weights, self.layers, strict=True))


class Cell(nn.Module):
    def __init__(self, steps: int, multiplier: int, cpp: int, cp: int, c: int,
                 reduction: bool, reduction_prev: bool) -> None:
        super().__init__()
        self.reduction = reduction
        self.reduction_prev = reduction_prev
        # after a reduction cell the cell before last has twice the resolution: halve it
        self.preprocess0 = (FactorizedReduce(cpp, c, affine=False) if reduction_prev
                            else ReLUConvBN(cpp, c, 1, 1, 0, affine=False))
        self.preprocess1 = ReLUConvBN(cp, c, 1, 1, 0, affine=False)
        self.steps = steps
        self.multiplier = multiplier
        self.layers = nn.ModuleList()
        for i in range(steps):
            for j in range(2 + i):  # node i reads both cell inputs and every earlier node
                self.layers.append(MixedLayer(c, 2 if reduction and j < 2 else 1))

    def forward(self, s0: torch.Tensor, s1: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        offset = 0
        for _ in range(self.steps):
            node = sum(self.layers[offset + j](h, weights[offset + j])
                       for j, h in enumerate(states))
            offset += len(states)
            states.append(node)
        return torch.cat(states[-self.multiplier:], dim=1)


class Network(nn.Module):
    def __init__(self, c: int, num_classes: int, layers: int, criterion: nn.Module,
                 steps: int = 4, multiplier: int = 4, stem_multiplier: int = 3) -> None:
        super().__init__()
        self.c, self.num_classes, self.layers = c, num_classes, layers
        self.criterion = criterion
        self.steps, self.multiplier = steps, multiplier
        c_curr = stem_multiplier * c
        self.stem = nn.Sequential(nn.Conv2d(3, c_curr, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c_curr))
        cpp, cp, c_curr = c_curr, c_curr, c
        self.cells = nn.ModuleList()
        reduction_prev = False
        for i in range(layers):
            reduction = i in (layers // 3, 2 * layers // 3)
            if reduction:
                c_curr *= 2
            self.cells.append(Cell(steps, multiplier, cpp, cp, c_curr, reduction,
                                   reduction_prev))
            reduction_prev = reduction
            cpp, cp = cp, multiplier * c_curr
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cp, num_classes)

    def forward(self, x: torch.Tensor, alphas: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        alpha_reduce, alpha_normal = alphas
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            weights = F.softmax(alpha_reduce if cell.reduction else alpha_normal, dim=-1)
            s0, s1 = s1, cell(s0, s1, weights)
        out = self.global_pooling(s1)
        return self.classifier(out.view(out.size(0), -1))

    def loss(self, x: torch.Tensor, alphas: tuple[torch.Tensor, torch.Tensor],
             target: torch.Tensor, acc: bool = False) -> Any:
        logits = self(x, alphas)
        if not acc:
            return self.criterion(logits, target)
        correct = (logits.argmax(dim=1) == target).double().sum().item()
        return self.criterion(logits, target), correct

    def genotype(self, alphas: tuple[torch.Tensor, torch.Tensor]) -> Genotype:
        """The two strongest incoming edges of every node and each edge's strongest
        operation other than "none"."""
        none = PRIMITIVES.index("none")

        def parse(weights: torch.Tensor) -> list[tuple[str, int]]:
            gene: list[tuple[str, int]] = []
            start = 0
            for i in range(self.steps):
                edges = weights[start:start + i + 2].tolist()
                strength = [max(w for k, w in enumerate(row) if k != none) for row in edges]
                for j in sorted(range(i + 2), key=lambda e: -strength[e])[:2]:
                    best = max((k for k in range(len(PRIMITIVES)) if k != none),
                               key=lambda k, row=edges[j]: row[k])
                    gene.append((PRIMITIVES[best], j))
                start += i + 2
            return gene

        alpha_reduce, alpha_normal = alphas
        concat = list(range(2 + self.steps - self.multiplier, self.steps + 2))
        return Genotype(normal=parse(F.softmax(alpha_normal, dim=-1).detach()),
                        normal_concat=concat,
                        reduce=parse(F.softmax(alpha_reduce, dim=-1).detach()),
                        reduce_concat=concat)


class Architecture(nn.Module):
    def __init__(self, steps: int) -> None:
        super().__init__()
        edges = sum(2 + i for i in range(steps))
        self.alpha_normal = nn.Parameter(torch.randn(edges, len(PRIMITIVES)))
        self.alpha_reduce = nn.Parameter(torch.randn(edges, len(PRIMITIVES)))
        with torch.no_grad():  # start near the uniform mixture
            self.alpha_normal.mul_(1e-3)
            self.alpha_reduce.mul_(1e-3)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.alpha_reduce, self.alpha_normal


# ----- data (a CIFAR-10 stand-in) ------------------------------------------------------------
def dataset() -> tuple[TensorDataset, TensorDataset]:
    """Training images whose class is the brightest of 4 image quadrants (plus label noise),
    and held-out images; from a private generator."""
    g = torch.Generator().manual_seed(0)

    def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 3, SIDE, SIDE, generator=g, dtype=torch.float64)
        h = SIDE // 2
        quadrants = torch.stack([x[:, :, :h, :h], x[:, :, :h, h:], x[:, :, h:, :h],
                                 x[:, :, h:, h:]], 1).mean((2, 3, 4))
        noisy = torch.rand(n, generator=g) < 0.2
        y = torch.where(noisy, torch.randint(0, CLASSES, (n,), generator=g),
                        quadrants.argmax(1))
        return x, y

    return TensorDataset(*images(NUM_SAMPLES)), TensorDataset(*images(16))


def run(impl: str, strategy: str = "default", **overrides: Any) -> dict[str, Any]:
    """Search for ``train_iters`` iterations; the problems' initial and final states (with
    the BatchNorm statistics), the losses each problem logged (rank 0), the validation
    records (rank 0) and the final learning rates."""
    b = api(impl)
    args = {**HPARAMS, **overrides}
    world, _ = place()
    batch = GLOBAL_BATCH // world
    losses: list[tuple[str, int, float]] = []
    validations: list[tuple[int, float, dict[str, Any]]] = []

    torch.manual_seed(0)  # the original's generator state is whatever it is at this point
    train_data, valid_data = dataset()
    test_queue = DataLoader(valid_data, batch_size=batch, shuffle=False)
    num_train = len(train_data)
    indices = list(range(num_train))
    split = math.floor(args["train_portion"] * num_train)
    train_iters = int(args["epochs"] * (num_train * args["train_portion"] // GLOBAL_BATCH + 1)
                      * args["unroll_steps"])

    arch_net = Architecture(steps=args["arch_steps"]).double()
    arch_optimizer = torch.optim.Adam(arch_net.parameters(), lr=args["arch_lr"],
                                      betas=(0.5, 0.999), weight_decay=args["arch_wd"])
    arch_loader = DataLoader(train_data, batch_size=batch,
                             sampler=SubsetRandomSampler(indices[split:]))
    criterion = nn.CrossEntropyLoss()
    classifier_net = Network(args["init_ch"], CLASSES, args["layers"], criterion,
                             steps=args["arch_steps"], multiplier=args["multiplier"],
                             stem_multiplier=args["stem_multiplier"]).double()
    classifier_optimizer = torch.optim.SGD(classifier_net.parameters(), lr=args["lr"],
                                           momentum=args["momentum"], weight_decay=args["wd"])
    classifier_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        classifier_optimizer, float(train_iters // args["unroll_steps"]),
        eta_min=args["lr_min"])
    classifier_loader = DataLoader(train_data, batch_size=batch,
                                   sampler=SubsetRandomSampler(indices[:split]))

    class Logged:
        def log(self, stats: dict[str, Any], global_step: Any) -> None:
            losses.append((self.name, self.count, float(stats["loss"])))

    class Arch(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            x, target = batch
            alphas = self.forward()
            return self.classifier.module.loss(x, alphas, target)

    class Classifier(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            x, target = batch
            alphas = self.arch()
            return self.module.loss(x, alphas, target)

    class NASEngine(b.Engine):  # type: ignore[misc,name-defined]
        @torch.no_grad()
        def validation(self) -> dict[str, float]:
            corrects, total = 0.0, 0
            for x, target in test_queue:
                _, correct = self.classifier.module.loss(x, self.arch(), target, acc=True)
                corrects += correct
                total += x.size(0)
            genotype = self.classifier.module.genotype(self.arch())
            validations.append((self.global_step, corrects / total, genotype._asdict()))
            return {"acc": corrects / total}

    outer_config = b.Config(retain_graph=True, log_step=1)
    inner_config = b.Config(type="darts", unroll_steps=args["unroll_steps"], log_step=1)
    config = engine_config(b, impl, strategy, batchnorm=True,
                           valid_step=args["report_freq"] * args["unroll_steps"],
                           train_iters=train_iters, roll_back=True)
    outer = Arch(name="arch", module=arch_net, optimizer=arch_optimizer,
                 train_data_loader=arch_loader, config=outer_config)
    inner = Classifier(name="classifier", module=classifier_net,
                       optimizer=classifier_optimizer, scheduler=classifier_scheduler,
                       train_data_loader=classifier_loader, config=inner_config)
    problems = [outer, inner]
    engine = NASEngine(config=config, problems=problems,
                       dependencies={"l2u": {inner: [outer]}, "u2l": {outer: [inner]}})
    initial = snapshot(problems)
    engine.run()
    return {"initial": initial, "final": snapshot(problems), "losses": losses,
            "validations": validations, "lr": learning_rates(problems),
            "counts": {p.name: p.count for p in problems}, "train_iters": train_iters}
