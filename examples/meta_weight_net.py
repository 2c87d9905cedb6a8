"""Learning to reweight noisy labels (Meta-Weight-Net) on scikit-learn's digits, as a bilevel
problem run by metadist's Engine.

    metadist run --nproc 2 examples/meta_weight_net.py [--strategy ddp|zero1|zero2|zero3]

40% of the training labels are replaced by a random other class. The lower level trains a
classifier on them with a per-sample weighted loss; the upper level trains a small MLP that
maps each sample's loss to its weight, so that the classifier does well on a small clean meta
set (10 digits per class). The hypergradient flows through the classifier's update (``--method``
darts by default; unrolled, neumann and cg work too) and is exact across ranks. A plain
classifier trained on the same noisy labels is the baseline; both are scored on the clean test
set. Nothing is downloaded (the digits ship with scikit-learn).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from metadist.meta import Engine, EngineConfig, Problem, ProblemConfig


def noisy_digits(noise: float, seed: int = 0) -> tuple[TensorDataset, TensorDataset,
                                                        TensorDataset, float]:
    """(noisy training set, clean meta set, clean test set, fraction of labels flipped)."""
    from sklearn.datasets import load_digits

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(y_np, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    meta = torch.cat([order[y[order] == c][:10] for c in range(10)])  # 10 clean per class
    rest = order[~torch.isin(order, meta)]
    train, test = rest[:1200], rest[1200:]
    labels = y[train].clone()
    flip = torch.rand(len(train), generator=g) < noise
    # symmetric noise: a uniformly random *other* class
    labels[flip] = (labels[flip] + torch.randint(1, 10, (int(flip.sum()),), generator=g)) % 10
    flipped = (labels != y[train]).float().mean().item()
    return (TensorDataset(x[train], labels), TensorDataset(x[meta], y[meta]),
            TensorDataset(x[test], y[test]), flipped)


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


class Classifier(Problem):
    """Lower level: the classifier on noisy labels, each sample's loss weighted by the
    weighting network (detached input: the weight depends on the loss value, not on how the
    classifier could change it)."""

    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        losses = nn.functional.cross_entropy(self(x), y, reduction="none")
        weights = self.weighting(losses.detach().unsqueeze(1)).squeeze(1)
        return (weights * losses).mean()


class Weighting(Problem):
    """Upper level: the loss-to-weight MLP, scored by the classifier on the clean meta set."""

    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.classifier(x), y)


class Plain(Problem):
    """The baseline: the same classifier, every noisy sample weighted 1."""

    def training_step(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


class Scored(Engine):
    """Validation on rank 0 (problems run on local replicas there): clean test accuracy, and
    what the weighting network currently maps losses to."""

    def __init__(self, *args: Any, test_set: TensorDataset, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.test_set = test_set
        self.curve: list[tuple[int, float]] = []
        self.learned: tuple[Tensor, Tensor] | None = None

    def validation(self) -> dict[str, float]:
        x, y = self.test_set.tensors
        device = self.world.device
        with torch.no_grad():
            accuracy = (self.classifier(x.to(device)).argmax(1).cpu() == y).float().mean().item()
            if "weighting" in self.problems:
                losses = torch.linspace(0, 6, 100, device=device).unsqueeze(1)
                self.learned = (losses.cpu(), self.weighting(losses).cpu())
        self.curve.append((self.global_step, accuracy))
        return {"accuracy": accuracy}


def train(args: argparse.Namespace, reweight: bool, data: tuple[TensorDataset, ...]) -> Scored:
    train_set, meta_set, test_set = data
    n = metadist.world().world_size
    if args.batch_size % n or 50 % n:
        raise SystemExit(f"--batch-size {args.batch_size} and the meta batch (50) must divide "
                         f"by {n} ranks")
    loader = DataLoader(train_set, batch_size=args.batch_size // n, shuffle=True, drop_last=True)
    net = classifier()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # The scheduler stays bound to this optimizer object through the engine's setup.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.iters)
    config = EngineConfig(strategy=args.strategy, train_iters=args.iters,
                          valid_step=args.valid_step)
    if not reweight:
        return Scored([Plain("classifier", net, opt, scheduler, train_data_loader=loader)], config,
                      test_set=test_set)
    torch.manual_seed(1)
    wnet = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid())
    lower = Classifier("classifier", net, opt, scheduler, train_data_loader=loader,
                       config=ProblemConfig(method=args.method))
    upper = Weighting("weighting", wnet, torch.optim.Adam(wnet.parameters(), lr=args.meta_lr),
                      train_data_loader=DataLoader(meta_set, batch_size=50 // n, shuffle=True,
                                                   drop_last=True))
    return Scored([lower, upper], config, {"u2l": {upper: [lower]}, "l2u": {lower: [upper]}},
                  test_set=test_set)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--method", default="darts", help="unrolled, darts, neumann or cg")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--valid-step", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64, help="global, all ranks")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--meta-lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.4)
    ap.add_argument("--plot", default="out/meta_weight_net.png", help="PNG ('' to skip)")
    args = ap.parse_args(argv)

    start = time.perf_counter()
    train_set, meta_set, test_set, flipped = noisy_digits(args.noise)
    data = (train_set, meta_set, test_set)
    world = metadist.init()
    metadist.print(f"{len(train_set)} training digits ({flipped:.0%} labels flipped), "
                   f"{len(meta_set)} clean meta digits, {len(test_set)} test digits; "
                   f"{args.strategy} on {world.world_size} rank(s), method {args.method}")
    plain, mwn = train(args, False, data), train(args, True, data)
    plain.run()
    mwn.run()
    result = {"plain_accuracy": plain.last_validation.get("accuracy", float("nan")),
              "reweighted_accuracy": mwn.last_validation.get("accuracy", float("nan"))}
    metadist.print(f"clean test accuracy: plain {result['plain_accuracy']:.2%}, "
                   f"reweighted {result['reweighted_accuracy']:.2%} "
                   f"({time.perf_counter() - start:.1f}s)")
    if args.plot and world.rank == 0:
        _plot(args, plain, mwn)
        metadist.print(f"plot written to {args.plot}")
    return result


def _plot(args: argparse.Namespace, plain: Scored, reweighted: Scored) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for engine, label in ((plain, "plain"), (reweighted, "reweighted")):
        left.plot(*zip(*engine.curve, strict=True), marker="o", label=label)
    left.set_xlabel("iteration")
    left.set_ylabel("clean test accuracy")
    left.legend()
    if reweighted.learned is not None:
        losses, weights = reweighted.learned
        right.plot(losses.squeeze(1), weights.squeeze(1))
    right.set_xlabel("sample loss")
    right.set_ylabel("learned weight")
    fig.suptitle(f"Meta-Weight-Net, digits, {args.noise:.0%} symmetric label noise")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
    metadist.shutdown()
