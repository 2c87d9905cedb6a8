"""Train a classifier on scikit-learn's handwritten digits (shipped with the package, no
download) on every rank of the job: ``metadist demo digits --strategy ddp``.

Shows the one-line strategy switch: the loop below is plain PyTorch except for
``strategy.setup``, ``strategy.setup_dataloader`` and ``strategy.all_reduce``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import metadist


def load_digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise SystemExit("the digits demo needs scikit-learn: "
                         "pip install 'metadist[demo]'") from err
    x, y = sk_digits(return_X_y=True)
    features = torch.tensor(x, dtype=torch.float32)
    features = (features - features.mean(0)) / (features.std(0) + 1e-6)
    labels = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(order))
    train, test = order[:cut], order[cut:]
    return TensorDataset(features[train], labels[train]), TensorDataset(features[test],
                                                                         labels[test])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.BatchNorm1d(128),
                         nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--strategy", default="ddp", help="single, ddp, ... (metadist.strategy)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--plot", default="out/digits_loss.png", help="loss curve PNG ('' to skip)")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    options = {} if args.strategy in ("single", "dp") else {"sync_batchnorm": True}
    strategy = metadist.strategy(args.strategy, **options)
    world = strategy.world
    train_set, test_set = load_digits()
    net = make_model()
    model, optimizer = strategy.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    train = strategy.setup_dataloader(DataLoader(train_set, batch_size=args.batch_size,
                                                 shuffle=True))
    test = strategy.setup_dataloader(DataLoader(test_set, batch_size=256))
    metadist.print(f"{strategy!r} on {world.world_size} rank(s) ({world.backend}, "
                   f"{world.device}); {len(train_set)} training digits, global batch "
                   f"{args.batch_size * world.world_size}")

    curve: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(args.epochs), desc="epochs", disable=not strategy.is_global_zero)
    for _ in bar:
        model.train()
        total, count = torch.zeros(()), torch.zeros(())
        for x, y in train:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(strategy.device)), y.to(strategy.device))
            strategy.backward(loss)
            optimizer.step()
            total += loss.detach().cpu() * len(y)
            count += len(y)
        scheduler.step()
        epoch_loss = (strategy.all_reduce(total, "sum") / strategy.all_reduce(count, "sum")).item()
        curve.append(epoch_loss)
        bar.set_postfix(loss=f"{epoch_loss:.4f}")

    model.eval()
    correct, seen = torch.zeros(()), torch.zeros(())
    with torch.no_grad():
        for x, y in test:
            pred = model(x.to(strategy.device)).argmax(1).cpu()
            real = getattr(test, "local_samples", len(y))  # 0 for a stand-in batch
            correct += (pred[:real] == y[:real]).sum()
            seen += real
    accuracy = (strategy.all_reduce(correct, "sum") / strategy.all_reduce(seen, "sum")).item()
    metadist.print(f"final training loss {curve[-1]:.4f}, test accuracy {accuracy:.2%} "
                   f"({time.perf_counter() - start:.1f}s)")
    if args.plot and strategy.is_global_zero:
        _plot(curve, args.plot, f"{args.strategy}, {world.world_size} rank(s)")
        metadist.print(f"loss curve written to {args.plot}")
    metadist.shutdown()


def _plot(curve: list[float], path: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(curve) + 1), curve, marker="o", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
