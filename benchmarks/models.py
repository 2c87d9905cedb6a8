"""Benchmark workloads: the 25M-parameter MLP of the anchors and a small transformer."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp(width: int = 2048, depth: int = 6) -> nn.Module:
    """depth x (Linear(width, width), GELU) + Linear(width, 10): 25.2M parameters by default."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


class TinyTransformer(nn.Module):
    """A 4-layer pre-norm encoder language model (d=256, 4 heads, vocab 2048)."""

    def __init__(self, vocab: int = 2048, d: int = 256, layers: int = 4, seq: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(
            d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def workload(name: str, quick: bool = False) -> tuple[
        Callable[[], nn.Module], Callable[[int], list[Batch]],
        Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(model factory, batches for a rank, loss) of a named workload; ``quick`` shrinks the
    model about 200x so that a CI run checks the pipeline in seconds."""
    match name:
        case "mlp":
            width, depth = (256, 2) if quick else (2048, 6)

            def data(rank: int) -> list[Batch]:
                g = torch.Generator().manual_seed(rank)
                return [(torch.randn(32, width, generator=g),
                         torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]

            return partial(mlp, width, depth), data, nn.functional.cross_entropy
        case "transformer":
            vocab, d, layers, seq = (256, 64, 1, 16) if quick else (2048, 256, 4, 64)

            def tokens(rank: int) -> list[Batch]:
                g = torch.Generator().manual_seed(rank)
                out = []
                for _ in range(4):
                    t = torch.randint(0, vocab, (16, seq + 1), generator=g)
                    out.append((t[:, :-1], t[:, 1:]))
                return out

            def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   target.reshape(-1))

            return partial(TinyTransformer, vocab, d, layers, seq), tokens, lm_loss
    raise ValueError(f"workload {name!r} is not known; choose one of: mlp, transformer")


def zero3_unit_params(quick: bool = False) -> int:
    """The MLP's zero3 wrap threshold: one unit per Linear at either size."""
    return 10_000 if quick else 1_000_000


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
