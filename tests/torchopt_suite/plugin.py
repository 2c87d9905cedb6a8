"""pytest plugin for one run of TorchOpt 0.7.3's own test suite (tests/test_torchopt_suite.py
starts two: ``real`` and ``compat``).

* ``TORCHOPT_SUITE_SIDE=compat``: a meta-path finder makes ``import torchopt`` and every
  ``torchopt.<sub>`` resolve to ``metadist.compat.torchopt[.<sub>]`` (the same module objects),
  ahead of .peers/ where TorchOpt itself is installed; ``real`` leaves TorchOpt as it is.
* ``TORCHOPT_SUITE_PER_FILE=N``: a deterministic sample of at most N tests of every file
  (evenly spaced over the file's sorted test ids; the same ids on both sides); 0 runs all.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    per_file = int(os.environ.get("TORCHOPT_SUITE_PER_FILE", "0"))
    if per_file <= 0:
        return
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::")[0]].append(item)
    kept: list[pytest.Item] = []
    for group in by_file.values():
        group.sort(key=lambda i: test_id(i.nodeid))
        if len(group) <= per_file:
            kept += group
        else:
            step = len(group) / per_file
            kept += [group[int(k * step)] for k in range(per_file)]
    deselected = [i for i in items if i not in set(kept)]
    config.hook.pytest_deselected(items=deselected)
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
