"""Betty 0.2.1's examples/imagenet_pruning (main.py, model.py, util.py, filter.py), ported to
run on Betty 0.2.1 and on metadist.compat.betty with only the imports changed
(``run(impl, ...)``).

What is the original's, kept:

* model.py: ``ResNet`` of ``Bottleneck`` blocks (the default ``--layers 50``: 7x7 stem, max
  pool, four stages with 1x1 downsampling, average pool, ``fc``), its initialisation, the
  ``fc_ema`` head (a copy of ``fc``) whose logits come out beside ``fc``'s, ``ema_update``
  as written (it blends ``fc`` with itself: ``fc_ema`` becomes ``fc``); ``MLP(2, 100, 1)``
  with its hard gumbel softmax or, when ``test`` is truthy, the deterministic one.
* main.py: ``Inner`` weights its per-sample losses by ``self.outer(meta_inputs,
  self._global_step)`` (loss and cross entropy against the ``fc_ema`` prediction, detached;
  the step, >= 1, is the ``test`` flag: the deterministic branch); ``param_callback`` calls
  ``ema_update`` on ``self.module``, off "default" on ``self.module.module``; ``Outer``
  scores ``self.inner(inputs)``. SGD (momentum, weight decay) with MultiStepLR at 1/3 and 2/3
  of the run, Adam(lr=1e-5) for the meta network; both loaders shuffle the training set; the
  Configs and EngineConfig (``train_iters = epochs * epoch_iter``, ``valid_step =
  epoch_iter``); ``ReweightingEngine.validation`` (top-1/top-5 through ``accuracy`` and
  ``AverageMeter``, the best accuracies, classifier and reweighter unwrapped off "default").
* filter.py: each checkpoint's classifier and meta network, rebuilt and loaded, weigh the
  training set (validation transform, in order, ``test=True``); the samples sorted by the
  mean weight, highest first (``sorted_idx``, whose prefix ``get_subset_data`` keeps).

Changes: synthetic 40x40 uint8 images of 6 classes (colour patterns, noise, 20% flipped
labels; 32 training, 16 validation; private generator) instead of ImageNet's HDF5; the
transforms written here (RandomResizedCrop(32) and flip, or Resize(36) and CenterCrop(32);
/255, Normalize). Sample i's crop and flip draw from a generator seeded by i: on N ranks a
rank loads only its share of a batch, so global draws would differ from one process's (and
shift every later draw). One block per stage, 4 base channels (not 64); float64; global
batch 8; 3 epochs of 4 iterations (milestones after epochs 1 and 2 for 40 and 80 of 120; the
outer steps 6 times); ``unroll_step`` 2 (not 5), ``log_step`` 2 (the outer logs each step).
Epochs are short because at lr 0.1 this small BatchNorm network amplifies a rounding
difference about 3x per iteration (one ulp on the initial weights: 1e-11 absolute after 6
iterations, beyond the ranks' tolerance; 1e-13 after 4); at lr 0.01 it stops growing.
Validation keeps its checkpoints in memory (not ``torch.save``); the filter runs on all three
after training (on rank 0, where validation ran; the original averages five late ones). Left
out: ``--baseline``, ``--prune`` retraining, util.py's Horovod loops and printing,
``num_workers``/``pin_memory``. ``upper_sgd=True``: the meta network on plain SGD (lr 2e-3:
the weights move between 0.5 and 0.96 without saturating), whose step is proportional to the
hypergradient (Adam hides its scale). Betty 0.2.1 ran it with no other change.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from betty_programs.ported import (
    HiddenLayer,
    api,
    engine_config,
    learning_rates,
    place,
    snapshot,
)

CLASSES, RAW, CROP, RESIZE, GLOBAL_BATCH, N_TRAIN, N_VAL = 6, 40, 32, 36, 8, 32, 16
MEAN = torch.tensor((0.485, 0.456, 0.406), dtype=torch.float64).view(3, 1, 1)
STD = torch.tensor((0.229, 0.224, 0.225), dtype=torch.float64).view(3, 1, 1)
ARGS = dict(width=4, epochs=3, lr=0.1, momentum=0.9, weight_decay=1e-4,
            nesterov=False, meta_lr=1e-5, upper_sgd=False, meta_sgd_lr=2e-3, unroll_step=2,
            log_step=2, gradient_accumulation=1, precision="fp32", seed=0)


# ----- model.py ------------------------------------------------------------------------------
def deterministic_gumbel_softmax(logits: torch.Tensor, tau: float = 1) -> torch.Tensor:
    """The gumbel softmax with every uniform draw at 0.5."""
    u = 0.5 * torch.ones_like(logits)
    return F.softmax((logits - torch.log(-torch.log(u + 1e-20) + 1e-20)) / tau, dim=-1)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x if self.downsample is None else self.downsample(x)
        relu: torch.Tensor = self.relu(out)
        return relu


class MLP(nn.Module):
    """The meta network: per-sample (loss, ema loss) -> the first of two gumbel-softmax
    probabilities, a weight in [0, 1]."""

    def __init__(self, input_size: int = 1, hidden_size: int = 500, num_layers: int = 1) -> None:
        super().__init__()
        self.first_hidden_layer = HiddenLayer(input_size, hidden_size)
        self.rest_hidden_layers = nn.Sequential(
            *[HiddenLayer(hidden_size, hidden_size) for _ in range(num_layers - 1)])
        self.output_layer = nn.Linear(hidden_size, 2)

    def forward(self, x: torch.Tensor, test: Any = False) -> torch.Tensor:
        x = self.output_layer(self.rest_hidden_layers(self.first_hidden_layer(x)))
        x = (deterministic_gumbel_softmax(x, tau=0.5) if test
             else F.gumbel_softmax(x, tau=0.5, hard=True))
        return x[:, 0].unsqueeze(1)


class ResNet(nn.Module):
    def __init__(self, block: Any, layers: list[int], num_classes: int = 1000,
                 width: int = 64, side: int = 224) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool = nn.AvgPool2d(max(side // 32, 1), stride=1)  # 7 at 224
        self.fc = nn.Linear(8 * width * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2.0 / n))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()
        self.fc_ema = nn.Linear(8 * width * block.expansion, num_classes)  # for uncertainty
        self.fc_ema.weight.data.copy_(self.fc.weight.data)
        self.fc_ema.bias.data.copy_(self.fc.bias.data)

    def _make_layer(self, block: Any, planes: int, blocks: int, stride: int = 1
                    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, kernel_size=1,
                          stride=stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def ema_update(self) -> None:
        alpha = 0.95
        curr_weight, curr_bias = self.fc.weight.data, self.fc.bias.data
        self.fc_ema.weight.data.copy_(alpha * curr_weight + (1 - alpha) * self.fc.weight.data)
        self.fc_ema.bias.data.copy_(alpha * curr_bias + (1 - alpha) * self.fc.bias.data)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        x = x.view(x.size(0), -1)
        return self.fc(x), self.fc_ema(x)


def resnet50(width: int) -> ResNet:
    """Bottleneck blocks, one per stage (the original's [3, 4, 6, 3]), in float64."""
    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=CLASSES, width=width, side=CROP).double()


# ----- util.py -------------------------------------------------------------------------------
class AverageMeter:
    """Computes and stores the average and current value."""

    def __init__(self, name: str) -> None:
        self.name, self.count = name, 0
        self.val: Any = 0
        self.sum: Any = 0
        self.avg: Any = 0

    def update(self, val: Any, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)
             ) -> list[torch.Tensor]:
    """Accuracy (percent) over the k top predictions, for each k in ``topk``."""
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].reshape(-1).double().sum(0, keepdim=True)
                .mul_(100.0 / target.size(0)) for k in topk]


# ----- data (the ImageNet stand-in of dataset.py) ------------------------------------------------
def random_resized_crop(img: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """torchvision's RandomResizedCrop(CROP) parameters: scale (0.08, 1), ratio (3/4, 4/3),
    ten tries, else the whole image clamped to the ratio range."""
    height, width = img.shape[-2:]
    area = height * width
    for _ in range(10):
        target_area = area * float(torch.empty(1).uniform_(0.08, 1.0, generator=g))
        log_ratio = torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3), generator=g)
        aspect = math.exp(float(log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            i = int(torch.randint(0, height - h + 1, (1,), generator=g))
            j = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return resize(img[:, i:i + h, j:j + w], (CROP, CROP))
    return resize(center_crop(img, min(height, width)), (CROP, CROP))


def resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(img[None], size=size, mode="bilinear", align_corners=False,
                         antialias=True)[0]


def center_crop(img: torch.Tensor, size: int) -> torch.Tensor:
    top, left = (img.shape[-2] - size) // 2, (img.shape[-1] - size) // 2
    return img[:, top:top + size, left:left + size]


class ImageNet(Dataset[tuple[torch.Tensor, int]]):
    """Synthetic uint8 photos and labels; ``transform_type`` "train" (random resized crop
    and flip, drawn from a generator seeded by the sample's index) or "val" (resize,
    center crop); then ConvertImageDtype and Normalize."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform_type: str
                 ) -> None:
        self.images, self.labels, self.transform_type = images, labels, transform_type

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i].double() / 255
        if self.transform_type == "train":
            g = torch.Generator().manual_seed(1000 + i)
            image = random_resized_crop(image, g)
            if float(torch.rand(1, generator=g)) < 0.5:
                image = image.flip(-1)
        else:
            image = center_crop(resize(image, (RESIZE, RESIZE)), CROP)
        return (image - MEAN) / STD, int(self.labels[i])

    def __len__(self) -> int:
        return len(self.labels)


def photos() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each class a coarse 4x4 colour pattern, upsampled, plus noise; 20% of the training
    labels flipped (the samples a meta network should weigh down)."""
    g = torch.Generator().manual_seed(0)
    prototypes = F.interpolate(torch.rand(CLASSES, 3, 4, 4, generator=g), size=(RAW, RAW),
                               mode="bilinear", align_corners=False)

    def draw(n: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, CLASSES, (n,), generator=g)
        x = 0.6 * prototypes[y] + 0.4 * torch.rand(n, 3, RAW, RAW, generator=g)
        flip = torch.rand(n, generator=g) < noise
        y = torch.where(flip, torch.randint(0, CLASSES, (n,), generator=g), y)
        return (255 * x).round().to(torch.uint8), y

    return {"train": draw(N_TRAIN, 0.2), "val": draw(N_VAL, 0.0)}


# ----- filter.py -----------------------------------------------------------------------------
def filter_stage(checkpoints: dict[int, dict[str, Any]], dataset: Dataset[Any], batch: int,
                 args: dict[str, Any]) -> list[int]:
    """Sample indices sorted by the meta network's weight averaged over the checkpoints,
    highest first."""
    loader = DataLoader(dataset, batch_size=batch, shuffle=False)
    weights_total = []
    for idx in sorted(checkpoints):
        classifier = resnet50(args["width"])
        classifier.load_state_dict(checkpoints[idx]["cls"])
        classifier.eval()
        mwn = MLP(2, 100, 1).double()
        mwn.load_state_dict(checkpoints[idx]["mwn"])
        mwn.eval()
        weights = []
        with torch.no_grad():
            for inputs, labels in loader:
                outputs, ema_outputs = classifier(inputs)
                loss = F.cross_entropy(outputs, labels.long(), reduction="none").reshape(-1, 1)
                ema_prob = F.softmax(ema_outputs, dim=-1)
                ema_loss = torch.sum(-F.log_softmax(outputs, dim=-1) * ema_prob, dim=-1)
                weight = mwn(torch.cat([loss, ema_loss.reshape(-1, 1)], dim=1), test=True)
                weights.append(weight.squeeze(1))
        weights_total.append(torch.cat(weights))
    avg_weights = torch.stack(weights_total).mean(0)
    return [int(i) for i in torch.argsort(avg_weights, descending=True, stable=True)]


# ----- main.py -------------------------------------------------------------------------------
def run(impl: str, strategy: str = "default", **overrides: Any) -> dict[str, Any]:
    """Meta-train for ``epochs``, then filter; every problem's initial and final state (with
    the BatchNorm statistics), the outer losses (rank 0), the validations and the filter's
    order (rank 0), the ``_global_step`` values the inner loss read, the EMA updates."""
    b = api(impl)
    args = {**ARGS, **overrides}
    world, _ = place()
    batch = GLOBAL_BATCH // world
    losses: list[tuple[str, int, float]] = []
    validations: list[dict[str, Any]] = []
    checkpoints: dict[int, dict[str, Any]] = {}
    global_steps: list[int] = []
    ema_updates: list[int] = []

    torch.manual_seed(args["seed"])
    data = photos()
    train_dataset = ImageNet(*data["train"], transform_type="train")
    test_dataset = ImageNet(*data["val"], transform_type="val")
    train_loader = DataLoader(train_dataset, batch_size=batch, shuffle=True)
    meta_loader = DataLoader(train_dataset, batch_size=batch, shuffle=True)
    test_loader = DataLoader(test_dataset, batch_size=batch, shuffle=False)
    model = resnet50(args["width"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=args["momentum"],
                                weight_decay=args["weight_decay"], nesterov=args["nesterov"])
    meta_model = MLP(2, 100, 1).double()
    meta_optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(meta_model.parameters(), lr=args["meta_sgd_lr"]) if args["upper_sgd"]
        else torch.optim.Adam(meta_model.parameters(), lr=args["meta_lr"]))
    epoch_iter = int(len(train_dataset) / (world * batch * args["gradient_accumulation"]))
    total_iter = epoch_iter * args["epochs"]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[epoch_iter * 1, epoch_iter * 2], gamma=0.1)

    class Logged:
        name: str
        count: int

        def log(self, stats: dict[str, Any], global_step: Any) -> None:
            losses.append((self.name, self.count, float(stats["loss"])))

    class Outer(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, labels = batch
            outputs, *_ = self.inner(inputs)
            return F.cross_entropy(outputs, labels.long())

    class Inner(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, labels = batch
            outputs, ema_outputs = self.forward(inputs)
            loss_vector = F.cross_entropy(outputs, labels.long(), reduction="none")
            loss_vector_reshape = torch.reshape(loss_vector, (-1, 1))
            ema_prob = F.softmax(ema_outputs, dim=-1)
            ema_loss_vector = torch.sum(-F.log_softmax(outputs, dim=-1) * ema_prob, dim=-1)
            ema_loss_vector_reshape = torch.reshape(ema_loss_vector, (-1, 1))
            meta_inputs = torch.cat(
                [loss_vector_reshape.detach(), ema_loss_vector_reshape.detach()], dim=1)
            global_steps.append(self._global_step)
            weight = self.outer(meta_inputs, self._global_step)
            return torch.mean(weight * loss_vector_reshape)

        def param_callback(self) -> None:
            ema_updates.append(self.count)
            if strategy == "default":
                self.module.ema_update()
            else:
                self.module.module.ema_update()

    class ReweightingEngine(b.Engine):  # type: ignore[misc,name-defined]
        @torch.no_grad()
        def validation(self) -> dict[str, Any]:
            correct, total = 0, 0
            if not hasattr(self, "best_acc"):
                self.best_acc: float = -1
            if not hasattr(self, "best_acc1"):
                self.best_acc1: Any = -1
            if not hasattr(self, "best_acc5"):
                self.best_acc5: Any = -1
            top1, top5 = AverageMeter("Acc@1"), AverageMeter("Acc@5")
            for images, labels in test_loader:
                x, target = images.to(self.inner.device), labels.to(self.inner.device)
                out, *_ = self.inner(x)
                acc1, acc5 = accuracy(out, target, topk=(1, 5))
                top1.update(acc1[0], x.size(0))
                top5.update(acc5[0], x.size(0))
                correct += int((out.argmax(dim=1) == target).sum().item())
                total += x.size(0)
            acc = correct / total * 100
            self.best_acc = max(self.best_acc, acc)
            # top-5 selects the best model
            if self.best_acc5 < top5.avg:
                self.best_acc5, self.best_acc1 = top5.avg, top1.avg
            elif self.best_acc5 == top5.avg and self.best_acc1 <= top1.avg:
                self.best_acc1 = top1.avg
            classifier, reweighter = self.inner.module, self.outer.module
            if strategy != "default":
                classifier, reweighter = classifier.module, reweighter.module
            checkpoints[self.global_step] = {  # torch.save(...) of cls_/mwn_<step>.pt
                "cls": {k: v.detach().clone() for k, v in classifier.state_dict().items()},
                "mwn": {k: v.detach().clone() for k, v in reweighter.state_dict().items()}}
            stats = {"acc": acc, "best_acc": self.best_acc, "Acc@1": top1.avg,
                     "Best_Acc@1": self.best_acc1, "Acc@5": top5.avg,
                     "Best_Acc@5": self.best_acc5}
            validations.append({"step": self.global_step,
                                **{k: float(v) for k, v in stats.items()}})
            return stats

    outer_config = b.Config(precision=args["precision"],
                            log_step=int(args["log_step"] // args["unroll_step"]),
                            retain_graph=True)
    inner_config = b.Config(type="darts", precision=args["precision"], log_step=-1,
                            unroll_steps=args["unroll_step"],
                            gradient_accumulation=args["gradient_accumulation"])
    config = engine_config(b, impl, strategy, batchnorm=True, train_iters=total_iter,
                           valid_step=epoch_iter)
    outer = Outer(name="outer", module=meta_model, optimizer=meta_optimizer,
                  train_data_loader=meta_loader, config=outer_config)
    inner = Inner(name="inner", module=model, optimizer=optimizer, scheduler=scheduler,
                  train_data_loader=train_loader, config=inner_config)
    problems = [inner, outer]
    dependencies = {"l2u": {inner: [outer]}, "u2l": {outer: [inner]}}
    engine = ReweightingEngine(config=config, problems=problems, dependencies=dependencies)
    initial = snapshot(problems)
    engine.run()
    final = snapshot(problems)
    scoring = ImageNet(*data["train"], transform_type="val")
    sorted_idx = filter_stage(checkpoints, scoring, 2 * GLOBAL_BATCH, args) if checkpoints else []
    return {"initial": initial, "final": final, "losses": losses, "lr": learning_rates(problems),
            "counts": {p.name: p.count for p in problems}, "validations": validations,
            "sorted_idx": sorted_idx, "global_steps": global_steps, "ema_updates": ema_updates}
