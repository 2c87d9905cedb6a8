"""torch.compile under zero3 (and ddp): training steps per second, compiled vs eager.

    python -m benchmarks.compiled [--world 2] [--strategies zero3,ddp] [--models mlp,block]
                                  [--backend inductor] [--reps 10]

Per rank, two copies of one model set up by the same strategy, one eager and one compiled
before setup (``torch.compile(net)``, which metadist compiles per piece: each unit's block),
train on the same batches; their steps alternate, warm-up (and so compilation, timed
separately) discarded, medians. The losses of the two are compared after the run.

* ``mlp``: 4 residual blocks Linear(512, 2048) -> GELU -> Linear(2048, 512), batch 64.
* ``block``: 2 ``nn.TransformerEncoderLayer`` (d_model 256, 4 heads, ff 1024), batch 16 x 64.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

import metadist
from benchmarks.common import Results, alternate, output_args, parse


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _model(name: str) -> tuple[nn.Module, tuple[type[nn.Module], ...], torch.Tensor]:
    torch.manual_seed(0)
    match name:
        case "mlp":
            return (nn.Sequential(*[MLPBlock(512) for _ in range(4)]), (MLPBlock,),
                    torch.randn(64, 512))
        case "block":
            layers = [nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
                      for _ in range(2)]
            return nn.Sequential(*layers), (nn.TransformerEncoderLayer,), torch.randn(16, 64, 256)
    raise ValueError(f"model {name!r} is not known; choose mlp or block")


def _body(strategy: str, model_name: str, backend: str, reps: int) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for mode in ("eager", "compiled"):
        net, units, x = _model(model_name)
        if mode == "compiled":
            net = torch.compile(net, backend=backend)
        options = {"wrap_classes": units} if strategy in ("zero3", "hsdp") else {}
        model, opt = metadist.strategy(strategy, **options).setup(
            net, torch.optim.SGD(net.parameters(), lr=1e-3))
        losses: list[float] = []

        def step(model: nn.Module = model, opt: Any = opt, x: torch.Tensor = x,
                 losses: list[float] = losses) -> None:
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())

        start = time.perf_counter()
        step()  # compiles
        runs[mode] = {"step": step, "first": time.perf_counter() - start, "losses": losses}
    seconds = alternate({mode: run["step"] for mode, run in runs.items()}, reps)
    eager, compiled = runs["eager"]["losses"], runs["compiled"]["losses"]
    return {"steps/s": {mode: 1.0 / s for mode, s in seconds.items()},
            "first step s": {mode: run["first"] for mode, run in runs.items()},
            "max loss diff": max(abs(a - b) for a, b in zip(eager, compiled, strict=True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--strategies", default="zero3,ddp")
    ap.add_argument("--models", default="mlp,block")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--reps", type=int, default=10)
    output_args(ap)
    args = parse(ap, models="mlp", reps=2, backend="aot_eager")
    with Results("compiled", args) as results:
        results.heading(f"torch.compile: world {args.world}, backend {args.backend}, "
                        f"{torch.get_num_threads()} threads")
        rows, data = [], []
        for strategy in args.strategies.split(","):
            for name in args.models.split(","):
                got = metadist.launch(_body, args.world, args=(strategy, name, args.backend,
                                                               args.reps), threads=1)[0]
                rate, first = got["steps/s"], got["first step s"]
                rows.append([strategy, name, f"{rate['eager']:.1f}", f"{rate['compiled']:.1f}",
                             f"{rate['compiled'] / rate['eager']:.2f}",
                             f"{first['eager']:.2f}", f"{first['compiled']:.1f}",
                             f"{got['max loss diff']:.1e}"])
                data.append({"strategy": strategy, "model": name, **got})
        results.table(["strategy", "model", "eager steps/s", "compiled steps/s", "speed-up",
                       "1st eager s", "1st compiled s", "max loss diff"], rows, key="compile")
        results.data["runs"] = data


if __name__ == "__main__":
    main()
