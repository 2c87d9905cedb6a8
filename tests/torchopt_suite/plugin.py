"""pytest plugin for one run of TorchOpt 0.7.3's own test suite (tests/test_torchopt_suite.py
starts two: ``real`` and ``compat``).

* ``TORCHOPT_SUITE_SIDE=compat``: a meta-path finder makes ``import torchopt`` and every
  ``torchopt.<sub>`` resolve to ``metadist.compat.torchopt[.<sub>]`` (the same module objects),
  ahead of .peers/ where TorchOpt itself is installed; ``real`` leaves TorchOpt as it is.
* ``TORCHOPT_SUITE_PER_FILE=N`` (``file=M,...`` after it for files with a budget of their
  own): a deterministic sample of about N tests of every file, the same ids on both sides; 0
  runs all. Every test function runs, each with a covering sample of its parametrisations
  (every value of every parameter at least once); the rest of the budget is spread evenly
  over the file's other tests in sorted id order.
* ``TORCHOPT_SUITE_OUT=path``: the outcome of every test (and every file that failed to
  collect) as JSON.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
from collections import defaultdict
from types import ModuleType
from typing import Any

import pytest

_PREFIX = "metadist.compat.torchopt"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def test_id(nodeid: str) -> str:
    """A test's id without the memory addresses that parametrised reprs carry
    (``<function adam at 0x7f...>``), the same in every run and on both sides."""
    return _ADDRESS.sub("", nodeid)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``torchopt[.x]`` is ``metadist.compat.torchopt[.x]``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchopt" and not fullname.startswith("torchopt."):
            return None
        real = _PREFIX + fullname[len("torchopt"):]
        try:
            module = importlib.import_module(real)
        except ModuleNotFoundError as e:
            if e.name == real:
                return None  # so the import fails as TorchOpt's would: no such module
            raise
        spec = importlib.machinery.ModuleSpec(fullname, self,
                                              is_package=hasattr(module, "__path__"))
        spec._module = module  # type: ignore[attr-defined]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return spec._module  # type: ignore[attr-defined, no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        return None


if os.environ.get("TORCHOPT_SUITE_SIDE") == "compat":
    sys.meta_path.insert(0, _Alias())

_outcomes: dict[str, str] = {}
_broken: dict[str, str] = {}


def _budgets(spec: str) -> tuple[int, dict[str, int]]:
    """``"40,test_implicit.py=16"``: the default budget and the files with their own."""
    default, *own = spec.split(",")
    return int(default), {f: int(n) for f, n in (o.split("=") for o in own)}


def _values(item: pytest.Item) -> set[tuple[int, str]]:
    """The values a parametrised test runs with, read from its id (the same on both sides,
    where the objects' reprs need not be): each ``-``-separated part outside parentheses,
    with its position."""
    inside = test_id(item.nodeid).partition("[")[2][:-1]
    parts, depth, start = [], 0, 0
    for at, c in enumerate(inside):
        depth += (c in "([") - (c in ")]")
        if c == "-" and depth == 0:
            parts.append(inside[start:at])
            start = at + 1
    parts.append(inside[start:])
    return set(enumerate(p for p in parts if p))


def _covering(tests: list[pytest.Item]) -> list[pytest.Item]:
    """Tests of one function that run every value of every parameter at least once: each
    pick the first (in id order) that adds the most values not run yet."""
    wanted = set().union(*(_values(t) for t in tests))
    picked: list[pytest.Item] = []
    while wanted or not picked:
        best = max(tests, key=lambda t: len(_values(t) & wanted))
        picked.append(best)
        wanted -= _values(best)
    return picked


def _sample(tests: list[pytest.Item], budget: int) -> list[pytest.Item]:
    """A covering sample of every function of one file, then evenly spaced others up to
    ``budget``."""
    tests = sorted(tests, key=lambda i: test_id(i.nodeid))
    if len(tests) <= budget:
        return tests
    by_function: dict[str, list[pytest.Item]] = defaultdict(list)
    for t in tests:
        by_function[t.nodeid.split("[")[0]].append(t)
    kept = {id(t): t for group in by_function.values() for t in _covering(group)}
    rest = [t for t in tests if id(t) not in kept]
    more = max(budget - len(kept), 0)
    if more:
        step = len(rest) / more
        kept.update((id(t), t) for t in (rest[int(k * step)] for k in range(min(more, len(rest)))))
    return [t for t in tests if id(t) in kept]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default, own = _budgets(os.environ.get("TORCHOPT_SUITE_PER_FILE", "0"))
    if default <= 0:
        return
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::")[0]].append(item)
    kept: list[pytest.Item] = []
    for name, group in by_file.items():
        kept += _sample(group, own.get(name, default))
    chosen = {id(i) for i in kept}
    config.hook.pytest_deselected(items=[i for i in items if id(i) not in chosen])
    items[:] = kept


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _broken[report.nodeid] = str(report.longrepr)[-2000:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        key = test_id(report.nodeid)
        if key not in _outcomes or _outcomes[key] == "passed":
            _outcomes[key] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("TORCHOPT_SUITE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"outcomes": _outcomes, "collection_errors": _broken}, f, indent=1)
