"""The package layering docs/architecture.md states, read from the sources' imports.

* Only strategies/ knows the strategies' own types: checkpoints, the meta layer and the rest
  read layouts through ``placements()`` and run modules through ``bind_parameters``, so that
  adding a strategy touches only strategies/.
* Lower layers import nothing above them; the one upward call (``Strategy.save``/``load``
  handing over to metadist.checkpoint when called) is named here, so a new one is a decision.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "metadist"

# Modules and names that belong to individual strategies (not the shared interface:
# base, module, placement, bind, step_chain, ...).
STRATEGY_OWN_MODULES = {
    "metadist.strategies.zero3.strategy", "metadist.strategies.zero",
    "metadist.strategies.zero3.flat",
    "metadist.strategies.zero3.units", "metadist.strategies.zero3.unit_state",
    "metadist.strategies.zero3.backward_holds", "metadist.strategies.zero3.backward_coordinator",
    "metadist.strategies.zero3.hsdp", "metadist.strategies.ddp", "metadist.strategies.dp",
    "metadist.strategies.single", "metadist.strategies.buckets",
    "metadist.strategies.zero3.unreached", "metadist.strategies.zero3.flat_layout",
}
STRATEGY_OWN_NAMES = {"ShardedModule", "OwnerLayout", "FlatLayout", "FlatParam", "Unit",
                      "Zero3Strategy", "HSDPStrategy", "DDPStrategy"}

LOWER = ("strategies", "comm", "runtime")
UPPER = ("metadist.checkpoint", "metadist.meta", "metadist.mapreduce", "metadist.compat")
ALLOWED_UPWARD = {("strategies/base.py", "metadist.checkpoint")}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import in ``path``, at any depth."""
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names]
            out.append((node.module, names))
            out.extend((f"{node.module}.{n}", []) for n in names)  # `from metadist import x`
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_sources_are_found() -> None:
    # The checks below would pass vacuously on an empty tree.
    files = _sources()
    assert len(files) > 100
    assert any(m == "metadist.strategies.placement" for f in files for m, _ in _imports(f))


def test_only_strategies_know_a_strategys_own_types() -> None:
    offending = []
    for path in _sources():
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("strategies/"):
            continue
        for module, names in _imports(path):
            if module in STRATEGY_OWN_MODULES:
                offending.append(f"{rel} imports {module}")
            if module.startswith("metadist.strategies"):
                offending.extend(f"{rel} imports {n} from {module}"
                                 for n in names if n in STRATEGY_OWN_NAMES)
    assert not offending, "\n".join(offending)


def test_lower_layers_import_nothing_above_them() -> None:
    offending = []
    for path in _sources():
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(LOWER):
            continue
        for module, _ in _imports(path):
            upper = next((u for u in UPPER if module == u or module.startswith(u + ".")), None)
            if upper is not None and (rel, upper) not in ALLOWED_UPWARD:
                offending.append(f"{rel} imports {module}")
    assert not offending, "\n".join(offending)
