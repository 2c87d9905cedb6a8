"""Run a TorchOpt program with ``import torchopt`` (and every ``torchopt.<sub>``) resolved to
metadist.compat.torchopt, nothing else changed: ``python as_compat.py program.py args...``
(under ``metadist run`` for a distributed one). The aliasing is the suite's
(tests/torchopt_suite/plugin.py)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torchopt_suite"))
os.environ["TORCHOPT_SUITE_SIDE"] = "compat"
import plugin  # noqa: F401 - installs the import alias

program, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(program, run_name="__main__")
