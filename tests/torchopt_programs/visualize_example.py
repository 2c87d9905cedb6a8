"""TorchOpt 0.7.3's examples/visualize.py (its ``draw_torchopt``), ported for the comparison
with TorchOpt itself: written against ``import torchopt`` (as_compat.py runs it on the drop-in),
on the CPU, without torchviz. One MetaAdam step of a linear net with a meta-parameter, the two
states extracted with ``enable_visual=True`` and the graph of the next loss drawn with
``torchopt.visual.make_dot``. ``--out``: the graph's DOT source with the node ids (memory
addresses) renumbered in order of appearance, as JSON; ``--svg``: also rendered (needs
graphviz's ``dot``). ``--accelerated``: ``use_accelerated_op=True``, as the example has
it; ``--show``: ``show_attrs`` and ``show_saved`` too (the example leaves them off).
"""

from __future__ import annotations

import argparse
import json
import re

import torch
import torch.nn.functional as F
import torchopt
from torch import nn


class Net(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, meta_param: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + meta_param


def draw(accelerated: bool, show: bool, dim: int = 5, batch_size: int = 2) -> object:
    torch.manual_seed(0)
    net = Net(dim)
    optimizer = torchopt.MetaAdam(net, lr=1e-3, use_accelerated_op=accelerated)
    meta_param = torch.tensor(1.0, requires_grad=True)
    xs = torch.ones(batch_size, dim)
    pred = net(xs, meta_param)
    loss = F.mse_loss(pred, torch.ones_like(pred))
    state_0 = torchopt.extract_state_dict(net, enable_visual=True, visual_prefix="step0.")
    optimizer.step(loss)
    state_1 = torchopt.extract_state_dict(net, enable_visual=True, visual_prefix="step1.")
    pred = net(xs, meta_param)
    loss = F.mse_loss(pred, torch.ones_like(pred))
    return torchopt.visual.make_dot(loss, [state_0, state_1, {meta_param: "meta_param"}],
                                    show_attrs=show, show_saved=show)


def normalized(source: str) -> list[str]:
    """The DOT lines with every node id replaced by its order of first appearance.

    A tensor an autograd function of the program's own (the fused Adam's) saved is drawn as
    an edge and an orange node where it is reached; its id is the address of an object made
    for the drawing, which Python may hand to the next such object, so each of those
    drawings gets an id of its own (in both implementations' drawings alike)."""
    lines = [line.strip() for line in source.splitlines()]
    for i in range(len(lines) - 1):
        edge = re.fullmatch(r"(\d{6,}) -> (\d{6,})", lines[i])
        if not (edge and lines[i + 1].startswith(f"{edge.group(1)} [")):
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].endswith("]"))
        if "fillcolor=orange" in lines[end]:  # the node statement may span lines
            fresh = str(10**12 + i)
            lines[i] = lines[i].replace(edge.group(1), fresh, 1)
            lines[i + 1] = lines[i + 1].replace(edge.group(1), fresh, 1)
    ids: dict[str, str] = {}

    def rename(m: re.Match[str]) -> str:
        return ids.setdefault(m.group(0), f"n{len(ids)}")

    return [re.sub(r"\b\d{6,}\b", rename, line) for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerated", action="store_true")
    parser.add_argument("--show", action="store_true")
    parser.add_argument("--svg", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dot = draw(args.accelerated, args.show)
    if args.svg:
        dot.render(args.svg, format="svg")  # type: ignore[attr-defined]
    with open(args.out, "w") as f:
        json.dump(normalized(dot.source), f, indent=0)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
