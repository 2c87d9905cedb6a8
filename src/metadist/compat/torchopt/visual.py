"""TorchOpt's ``torchopt.visual``: the autograd graph behind tensors as a graphviz ``Digraph``
(graphviz is an optional dependency, imported on use: ``pip install graphviz``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.utils import ModuleState

__all__ = ["make_dot", "resize_graph"]

_NODE = {"style": "filled", "shape": "box", "align": "left", "fontsize": "10",
         "ranksep": "0.1", "height": "0.2", "fontname": "monospace"}


def _graphviz() -> Any:
    try:
        import graphviz
    except ImportError as e:  # pragma: no cover - optional
        raise ImportError("torchopt.visual needs graphviz: pip install graphviz") from e
    return graphviz


def _names(params: Any) -> dict[int, str]:
    """id(tensor or grad_fn) -> name, from name->tensor mappings, ModuleStates (their
    ``visual_contents``) or iterables of (name, tensor) pairs."""
    out: dict[int, str] = {}
    groups = params if isinstance(params, list | tuple) else [params]
    for group in groups:
        if group is None:
            continue
        if isinstance(group, ModuleState):
            for key, value in (group.visual_contents or {}).items():
                out[id(key)] = value[0] if isinstance(value, tuple) else value
        elif isinstance(group, Mapping):
            out.update({id(t): name for name, t in group.items()})
        else:
            out.update({id(t): name for name, t in group})
    return out


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.size())) + ")"


def make_dot(var: Any, params: Any = None, show_attrs: bool = False, show_saved: bool = False,
             max_attr_chars: int = 50) -> Any:
    """A ``Digraph`` of the backward graph of ``var`` (a tensor or a tree of them): outputs in
    dark olive green, named parameters in light blue, saved tensors in orange when
    ``show_saved``, other leaves in light blue with their shape."""
    graphviz = _graphviz()
    names = _names(params)
    dot = graphviz.Digraph(node_attr=_NODE, graph_attr={"size": "12,12"})
    seen: set[int] = set()

    def label(fn: Any) -> str:
        text = type(fn).__name__
        if show_attrs or show_saved:
            for attr in dir(fn):
                if attr.startswith("_saved_"):
                    value = getattr(fn, attr)
                    shown = _shape(value) if isinstance(value, torch.Tensor) else str(value)
                    text += f"\n{attr[7:]}: {shown[:max_attr_chars]}"
        return text

    def visit(fn: Any) -> None:
        if fn is None or id(fn) in seen:
            return
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            name = names.get(id(variable), "")
            dot.node(str(id(fn)), f"{name}\n{_shape(variable)}".strip(), fillcolor="lightblue")
        else:
            named = names.get(id(fn))
            dot.node(str(id(fn)), f"{named}\n{label(fn)}" if named else label(fn),
                     fillcolor="lightblue" if named else "lightgrey")
        for parent, _ in getattr(fn, "next_functions", ()):
            if parent is not None:
                visit(parent)
                dot.edge(str(id(parent)), str(id(fn)))

    outputs = [t for t in _tree.leaves(var) if isinstance(t, torch.Tensor)]
    for t in outputs:
        dot.node(str(id(t)), _shape(t), fillcolor="darkolivegreen1")
        if t.grad_fn is not None:
            visit(t.grad_fn)
            dot.edge(str(id(t.grad_fn)), str(id(t)))
    resize_graph(dot)
    return dot


def resize_graph(dot: Any, size_per_element: float = 0.5, min_size: float = 12.0) -> None:
    """Scale the drawing with the number of nodes and edges (in place)."""
    size = max(min_size, len(dot.body) * size_per_element)
    dot.graph_attr.update(size=f"{size},{size}")


