"""TorchOpt 0.7.3's examples/FuncTorch/parallel_train_torchopt.py, ported for the comparison
with TorchOpt itself (written against ``import torchopt``; as_compat.py runs it on the
drop-in): an ensemble of MLPs trained on two spirals with functorch, first by plain SGD, then
with ``torchopt.adam`` (init and update) under ``functorch.vmap``, models one at a time and
two in parallel. Kept as the example has it: the parallel loop passes the initial optimiser
state every step (it binds the new one to another name). ``--steps`` (2000 in the example)
and ``--out``: the losses the example prints, as JSON.
"""

from __future__ import annotations

import argparse
import json
import math

import functorch
import torch
import torch.nn.functional as F
import torchopt
from torch import nn


def make_spirals(n_samples: int, noise_std: float = 0.0, rotations: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    ts = torch.linspace(0, 1, n_samples)
    rs = ts**0.5
    thetas = rs * rotations * 2 * math.pi
    signs = torch.randint(0, 2, (n_samples,)) * 2 - 1
    labels = (signs > 0).to(torch.long)
    xs = rs * signs * torch.cos(thetas) + torch.randn(n_samples) * noise_std
    ys = rs * signs * torch.sin(thetas) + torch.randn(n_samples) * noise_std
    return torch.stack([xs, ys], dim=1), labels


class MLPClassifier(nn.Module):
    def __init__(self, hidden_dim: int = 32, n_classes: int = 2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), -1)


class Ensemble:
    """The example's ParallelTrainFunctorchTorchOpt."""

    def __init__(self, loss_fn: nn.Module, optimizer: torchopt.base.GradientTransformation
                 ) -> None:
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.func_model, _ = functorch.make_functional(MLPClassifier())

    def init_fn(self, model_idx: torch.Tensor) -> tuple:
        _, weights = functorch.make_functional(MLPClassifier())
        return weights, self.optimizer.init(weights)

    def train_step_fn(self, state: tuple, batch: torch.Tensor, targets: torch.Tensor
                      ) -> tuple:
        weights, opt_state = state

        def compute_loss(w: tuple, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(self.func_model(w, x), y)

        grads, loss = functorch.grad_and_value(compute_loss)(weights, batch, targets)
        updates, new_state = self.optimizer.update(grads, opt_state, inplace=False)
        return loss, (torchopt.apply_updates(weights, updates, inplace=False), new_state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    points, labels = make_spirals(100, noise_std=0.05)
    loss_fn = nn.NLLLoss()
    _, weights = functorch.make_functional(MLPClassifier())
    optimizer = torchopt.adam(lr=0.2)
    opt_state = optimizer.init(weights)
    ensemble = Ensemble(loss_fn, optimizer)
    log: dict[str, list] = {"single": [], "parallel": []}
    for i in range(args.steps):
        loss, (weights, opt_state) = ensemble.train_step_fn((weights, opt_state), points,
                                                            labels)
        if i % 100 == 0:
            log["single"].append(loss.item())
    parallel_init = functorch.vmap(ensemble.init_fn, randomness="same")
    parallel_step = functorch.vmap(ensemble.train_step_fn, in_dims=(0, None, None))
    weights, opt_state = parallel_init(torch.ones(2, 1))
    for i in range(args.steps):
        loss, (weights, _) = parallel_step((weights, opt_state), points, labels)
        if i % 200 == 0:
            log["parallel"].append(loss.tolist())
    log["weights"] = [w.double().sum().item() for w in weights]
    with open(args.out, "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()
