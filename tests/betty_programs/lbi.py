"""Betty 0.2.1's examples/learning_by_ignoring (main.py, model/resnet.py), ported to run on
Betty 0.2.1 and on metadist.compat.betty with only the imports changed (``run(impl, ...)``).

What is the original's, kept:

* Three problems built entirely by hooks (``configure_module``, ``configure_optimizer``,
  ``configure_scheduler``, ``configure_train_data_loader``, ``param_groups``): ``pretrain``
  (the leaf) trains on the source domain with per-sample losses weighted by
  ``sigmoid(self.reweight(inputs))``; ``finetune`` trains on the target domain with a
  regulariser pulling its non-``fc`` parameters towards pretrain's, read as
  ``self.pretrain.module.named_parameters()``; ``reweight`` (the top) is scored on the
  target's validation loader through ``self.finetune(inputs)`` plus the same regulariser
  between ``self.finetune.module.named_parameters()`` and
  ``self.pretrain.module.named_parameters()``.
* The dependencies ``u2l = {reweight: [pretrain]}``,
  ``l2u = {pretrain: [finetune, reweight], finetune: [reweight]}`` (so reweight's
  hypergradient runs along [reweight, finetune, pretrain, reweight] and
  [reweight, pretrain, reweight]), all darts, ``Config(retain_graph=True)`` on reweight,
  ``allow_unused=False`` on the other two; problems listed [reweight, finetune, pretrain].
* ``build_model``: a network whose ``fc`` head is replaced by a fresh Linear (initialised,
  then re-initialised xavier_uniform(gain 0.1) with zero bias); ``build_optimizer``: Adam
  with the non-fc parameters at ``features_lr`` and fc at ``classifier_lr``, weight decay;
  ``param_groups`` the same split; StepLR(step_size, gamma); the problems' own forwards
  (reweight's ``squeeze()``s its one logit per sample).
* The loaders: target train and target "valid" (the same samples) shuffled, source train
  shuffled with ``drop_last=True``; batches are (inputs, targets, domain index).
* ``set_random_seed(0)`` at the top (torch's part; numpy and ``random`` draw nothing here).

Shrunk: the ResNet-18 is a two-convolution network that keeps BatchNorm (train mode, running
statistics) and the ``fc`` head; 6x6 synthetic images of 3 classes (target 16 samples, source
28 so that drop_last drops 4), global batch 8; ``step_size`` 2 (the original's 400 is
never reached in a few iterations) and 4 iterations (reweight steps 4 times). Everything in
float64. ``LBIEngine.validation`` (test accuracy, best accuracy) is left out, and
``num_workers``/``pin_memory`` are dropped. Betty 0.2.1 ran it with no other change.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from betty_programs.ported import api, engine_config, learning_rates, place, snapshot

CLASSES, SIDE, GLOBAL_BATCH = 3, 6, 8
ARGS = dict(features_lr=1e-4, classifier_lr=1e-3, weight_decay=5e-4, lam=7e-3, gamma=0.1,
            step_size=2, train_iters=4, random_seed=0)


class ConvNet(nn.Module):
    """The ResNet-18 stand-in: conv-BN-ReLU twice, global average pooling, an ``fc`` head."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(self.pool(x).flatten(1))


def build_model(num_classes: int) -> nn.Module:
    model = ConvNet()
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    nn.init.xavier_uniform_(model.fc.weight, 0.1)
    nn.init.constant_(model.fc.bias, 0.0)
    return model.double()


def split_on_fc(model: nn.Module, args: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"params": [p for n, p in model.named_parameters() if "fc" not in n],
             "lr": args["features_lr"]},
            {"params": model.fc.parameters(), "lr": args["classifier_lr"]}]


def build_optimizer(model: nn.Module, args: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adam(split_on_fc(model, args), weight_decay=args["weight_decay"],
                            betas=(0.9, 0.999))


def domains() -> dict[str, TensorDataset]:
    """A target and a shifted source domain: the class is the channel with the largest
    mean, the source's images carry an offset and noisier labels; private generator."""
    g = torch.Generator().manual_seed(0)

    def domain(n: int, shift: float, noise: float, index: int) -> TensorDataset:
        x = torch.randn(n, 3, SIDE, SIDE, generator=g, dtype=torch.float64) + shift
        y = x.mean((2, 3)).argmax(1)
        flip = torch.rand(n, generator=g) < noise
        y = torch.where(flip, torch.randint(0, CLASSES, (n,), generator=g), y)
        return TensorDataset(x, y, torch.full((n,), index))

    return {"source": domain(28, 0.5, 0.3, 1), "target": domain(16, 0.0, 0.1, 0)}


def run(impl: str, strategy: str = "default", **overrides: Any) -> dict[str, Any]:
    """Train for ``train_iters`` iterations; every problem's initial and final state (with
    the BatchNorm statistics), the losses each problem logged (rank 0), the learning rates."""
    b = api(impl)
    args = {**ARGS, **overrides}
    world, _ = place()
    batch = GLOBAL_BATCH // world
    losses: list[tuple[str, int, float]] = []

    torch.manual_seed(args["random_seed"])  # set_random_seed
    data = domains()
    train_loader = DataLoader(data["target"], batch_size=batch, shuffle=True, drop_last=False)
    valid_loader = DataLoader(data["target"], batch_size=batch, shuffle=True, drop_last=False)
    train_source_loader = DataLoader(data["source"], batch_size=batch, shuffle=True,
                                     drop_last=True)

    class Logged:
        def log(self, stats: dict[str, Any], global_step: Any) -> None:
            losses.append((self.name, self.count, float(stats["loss"])))

    class Pretraining(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, targets, _ = batch
            loss_raw = F.cross_entropy(self.module(inputs), targets, reduction="none")
            weight = torch.sigmoid(self.reweight(inputs))
            return torch.mean(loss_raw * weight)

        def configure_train_data_loader(self) -> DataLoader[Any]:
            return train_source_loader

        def configure_module(self) -> nn.Module:
            return build_model(num_classes=CLASSES)

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return build_optimizer(self.module, args)

        def configure_scheduler(self) -> Any:
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=args["step_size"],
                                                   gamma=args["gamma"])

        def param_groups(self) -> list[dict[str, Any]]:
            return split_on_fc(self.module, args)

    def regulariser(module: nn.Module, anchor: nn.Module) -> Any:
        loss: Any = 0
        for (n1, p1), (_, p2) in zip(module.named_parameters(), anchor.named_parameters(),
                                     strict=True):
            lam = 0 if "fc" in n1 else args["lam"]
            loss = loss + lam * (p1 - p2).pow(2).sum()
        return loss

    class Finetuning(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, targets, _ = batch
            ce_loss = torch.mean(F.cross_entropy(self(inputs), targets, reduction="none"))
            return ce_loss + self.reg_loss()

        def reg_loss(self) -> Any:
            return regulariser(self.module, self.pretrain.module)

        def configure_train_data_loader(self) -> DataLoader[Any]:
            return train_loader

        def configure_module(self) -> nn.Module:
            return build_model(num_classes=CLASSES)

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return build_optimizer(self.module, args)

        def configure_scheduler(self) -> Any:
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=args["step_size"],
                                                   gamma=args["gamma"])

        def param_groups(self) -> list[dict[str, Any]]:
            return split_on_fc(self.module, args)

    class Reweighting(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x).squeeze()

        def training_step(self, batch: Any) -> torch.Tensor:
            inputs, targets, _ = batch
            loss = F.cross_entropy(self.finetune(inputs), targets)
            return loss + self.reg_loss()

        def reg_loss(self) -> Any:
            return regulariser(self.finetune.module, self.pretrain.module)

        def configure_train_data_loader(self) -> DataLoader[Any]:
            return valid_loader

        def configure_module(self) -> nn.Module:
            return build_model(num_classes=1)

        def configure_optimizer(self) -> torch.optim.Optimizer:
            return build_optimizer(self.module, args)

        def configure_scheduler(self) -> Any:
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=args["step_size"],
                                                   gamma=args["gamma"])

        def param_groups(self) -> list[dict[str, Any]]:
            return split_on_fc(self.module, args)

    reweight_config = b.Config(type="darts", retain_graph=True, log_step=1)
    finetune_config = b.Config(type="darts", unroll_steps=1, allow_unused=False, log_step=1)
    pretrain_config = b.Config(type="darts", unroll_steps=1, allow_unused=False, log_step=1)
    config = engine_config(b, impl, strategy, batchnorm=True, valid_step=20,
                           train_iters=args["train_iters"], roll_back=False)
    reweight = Reweighting(name="reweight", config=reweight_config)
    finetune = Finetuning(name="finetune", config=finetune_config)
    pretrain = Pretraining(name="pretrain", config=pretrain_config)
    problems = [reweight, finetune, pretrain]
    dependencies = {"u2l": {reweight: [pretrain]},
                    "l2u": {pretrain: [finetune, reweight], finetune: [reweight]}}
    engine = b.Engine(config=config, problems=problems, dependencies=dependencies)
    initial = snapshot(problems)
    engine.run()
    return {"initial": initial, "final": snapshot(problems), "losses": losses,
            "lr": learning_rates(problems), "counts": {p.name: p.count for p in problems}}
