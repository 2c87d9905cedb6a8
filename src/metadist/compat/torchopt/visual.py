"""TorchOpt's ``torchopt.visual``: the autograd graph behind tensors as a graphviz ``Digraph``
(graphviz is an optional dependency, imported on use: ``pip install graphviz``).

The drawing is TorchOpt's, node for node and in the same order (so the DOT source is the same
up to the ids, which are memory addresses): outputs dark olive green (a view's base dark olive
green 3, joined by a dotted edge), each backward node grey, each leaf's ``AccumulateGrad`` fed
by the leaf in light blue (named from ``params``), a node named by ``params`` (a
``ModuleState`` extracted with ``enable_visual=True``) light blue with its name and shape, the
tensors saved by custom autograd functions orange (and every saved tensor with
``show_saved``), the saved attributes as a table under the node's name with ``show_attrs``.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from typing import Any

import torch

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.utils import ModuleState

__all__ = ["make_dot", "resize_graph"]

SAVED_PREFIX = "_saved_"
_NODE = {"style": "filled", "shape": "box", "align": "left", "fontsize": "10",
         "ranksep": "0.1", "height": "0.2", "fontname": "monospace"}


def _graphviz() -> Any:
    try:
        import graphviz
    except ImportError as e:  # pragma: no cover - optional
        raise ImportError("torchopt.visual needs graphviz: pip install graphviz") from e
    return graphviz


def _saved(fn: Any) -> Iterable[tuple[str, Any]]:
    for attr in dir(fn):
        if attr.startswith(SAVED_PREFIX):
            yield attr[len(SAVED_PREFIX):], getattr(fn, attr)


def get_fn_name(fn: Any, show_attrs: bool, max_attr_chars: int) -> str:
    """The node's class name; with ``show_attrs``, a table of its saved attributes under it
    (tensors shown as ``[saved tensor(s)]``, values cut to ``max_attr_chars``)."""
    name = type(fn).__name__
    if not show_attrs:
        return name
    attrs: dict[str, str] = {}
    for key, val in _saved(fn):
        if isinstance(val, torch.Tensor):
            attrs[key] = "[saved tensor]"
        elif isinstance(val, tuple) and any(isinstance(t, torch.Tensor) for t in val):
            attrs[key] = "[saved tensors]"
        else:
            attrs[key] = str(val)
    if not attrs:
        return name
    width1 = max(map(len, attrs))
    width2 = min(max(map(len, attrs.values())), max(max_attr_chars, 3))

    def cut(s: str) -> str:
        return s[:width2 - 3] + "..." if len(s) > width2 else s

    rows = "\n".join(f"{k.ljust(width1)}: {cut(v).rjust(width2)}" for k, v in attrs.items())
    return f"{name}\n{'-' * max(width1 + width2 + 2, len(name))}\n{rows}"


def _param_map(params: Any) -> dict[Any, Any]:
    """tensor -> name, or grad_fn -> (name, tensor) (a ModuleState's ``visual_contents``),
    from the forms TorchOpt takes."""
    out: dict[Any, Any] = {}

    def add(group: Any) -> None:
        if isinstance(group, ModuleState) and group.visual_contents is not None:
            out.update(group.visual_contents)
        elif isinstance(group, Generator):
            out.update({v: k for k, v in group})
        else:
            out.update({v: k for k, v in group.items()})

    if params is None:
        return out
    if (isinstance(params, ModuleState) and params.visual_contents is not None) or \
            isinstance(params, Mapping | Generator):
        add(params)
    else:
        for group in params:
            add(group)
    return out


def _size(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.size())) + ")"


def make_dot(var: Any, params: Any = None, show_attrs: bool = False, show_saved: bool = False,
             max_attr_chars: int = 50) -> Any:
    """A ``Digraph`` of the backward graph of ``var`` (a tensor or a tree of them), with the
    tensors of ``params`` (a name -> tensor mapping, a ``ModuleState``, a generator of
    ``(name, tensor)`` or an iterable of those) named (module docstring)."""
    names = _param_map(params)
    dot = _graphviz().Digraph(node_attr=_NODE, graph_attr={"size": "12,12"})
    seen: set[Any] = set()
    kept: list[torch.Tensor] = []

    def var_name(t: torch.Tensor, name: str | None = None) -> str:
        return f"{name or names.get(t, '')}\n{_size(t)}"

    def saved_node(fn: Any, t: torch.Tensor, name: str) -> None:
        dot.edge(str(id(fn)), str(id(t)), dir="none")
        dot.node(str(id(t)), var_name(t, name), fillcolor="orange")

    def add_nodes(fn: Any) -> None:
        if fn in seen:
            return
        seen.add(fn)
        if show_saved:
            for key, val in _saved(fn):
                seen.add(val)
                if isinstance(val, torch.Tensor):
                    saved_node(fn, val, key)
                if isinstance(val, tuple):
                    for i, t in enumerate(val):
                        if isinstance(t, torch.Tensor):
                            saved_node(fn, t, f"{key}[{i}]")
        if hasattr(fn, "variable"):
            seen.add(fn.variable)
            dot.node(str(id(fn.variable)), var_name(fn.variable), fillcolor="lightblue")
            dot.edge(str(id(fn.variable)), str(id(fn)))
        label, color = get_fn_name(fn, show_attrs, max_attr_chars), None
        if fn in names:
            name, tensor = names[fn]
            label, color = f"{label}\n{name}\n{_size(tensor)}", "lightblue"
        dot.node(str(id(fn)), label, fillcolor=color)
        for parent, _ in getattr(fn, "next_functions", ()):
            if parent is not None:
                dot.edge(str(id(parent)), str(id(fn)))
                add_nodes(parent)
        for t in getattr(fn, "saved_tensors", ()):
            kept.append(t)  # alive until drawn: another tensor must not reuse its id
            dot.edge(str(id(t)), str(id(fn)))
            dot.node(str(id(t)), var_name(t), fillcolor="orange")

    def add_output(v: torch.Tensor, color: str = "darkolivegreen1") -> None:
        if v in seen:
            return
        seen.add(v)
        dot.node(str(id(v)), var_name(v), fillcolor=color)
        if v.grad_fn:
            add_nodes(v.grad_fn)
            dot.edge(str(id(v.grad_fn)), str(id(v)))
        if v._is_view():
            base: torch.Tensor = v._base  # type: ignore[assignment]
            add_output(base, color="darkolivegreen3")
            dot.edge(str(id(base)), str(id(v)), style="dotted")

    _tree.tree_map_(add_output, var)
    resize_graph(dot)
    return dot


def resize_graph(dot: Any, size_per_element: float = 0.5, min_size: float = 12.0) -> None:
    """Scale the drawing with the number of lines of its body (in place)."""
    size = max(min_size, len(dot.body) * size_per_element)
    dot.graph_attr.update(size=f"{size},{size}")
