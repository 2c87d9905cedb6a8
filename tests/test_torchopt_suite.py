"""TorchOpt 0.7.3's own test suite, unchanged, against TorchOpt and against the drop-in.

scripts/setup_peers.sh extracts the tests/ of TorchOpt's source distribution (checked against
its digest) into .peers/torchopt-tests/; tests/torchopt_suite/ holds what the sdist lacks and
what this comparison adds: a stand-in for TorchOpt's tests/helpers.py and a pytest plugin
(plugin.py) whose meta-path finder makes ``import torchopt`` resolve to
``metadist.compat.torchopt`` for the ``compat`` run only. Both runs take the same
deterministic sample of every file (the whole suite, 6381 tests, does not fit the suite's time
budget on two cores) in processes of their own, side by side: every test function, each with
every value of every parameter at least once, then others evenly spaced up to
:data:`PER_FILE` tests a file.

Every test that passes on TorchOpt must pass on the compat layer, except those in
:data:`BY_DESIGN` (each with its reason). The per-file counts are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / ".peers" / "torchopt-tests"
HERE = ROOT / "tests" / "torchopt_suite"
#: tests a file (the plugin's budget): test_implicit.py's each run JAX eagerly beside torch
#: for up to 100 inner steps (seconds a test, the rest take milliseconds), so it runs its
#: covering sample only
PER_FILE = "40,test_implicit.py=16"

#: tests that pass on TorchOpt and cannot on the compat layer, by design: id prefix -> reason
BY_DESIGN: dict[str, str] = {}


def _run(side: str, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TORCHOPT_SUITE_SIDE": side, "TORCHOPT_SUITE_PER_FILE": str(PER_FILE),
           "TORCHOPT_SUITE_OUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / ".peers")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "plugin", "-p", "no:cacheprovider",
           "-c", str(HERE / "pytest.ini"), "--rootdir", str(SUITE),
           "--continue-on-collection-errors", str(SUITE)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _file(nodeid: str) -> str:
    return nodeid.split("::", maxsplit=1)[0]


def _table(real: dict[str, str], compat: dict[str, str], broken: dict[str, str]) -> str:
    files = sorted({_file(n) for n in real} | {_file(n) for n in broken})
    lines = [f"{'file':28} {'real':>22} {'compat':>22}"]
    for f in files:
        r = Counter(o for n, o in real.items() if _file(n) == f)
        c = Counter(o for n, o in compat.items() if _file(n) == f)
        cell = "collection error" if f in broken else \
            f"{c['passed']}p {c['failed']}f {c['skipped']}s"
        counts = f"{r['passed']}p {r['failed']}f {r['skipped']}s"
        lines.append(f"{f:28} {counts:>22} {cell:>22}")
    tr, tc = Counter(real.values()), Counter(compat.values())
    lines.append(f"{'total':28} {tr['passed']:>13} passed {tc['passed']:>14} passed")
    return "\n".join(lines)


def test_torchopt_suite_passes_on_the_compat_layer(tmp_path: Path) -> None:
    if not SUITE.is_dir():
        raise RuntimeError(f"TorchOpt's tests are not in {SUITE}; run scripts/setup_peers.sh "
                           "(make test does)")
    runs = {side: (_run(side, tmp_path / f"{side}.json"), tmp_path / f"{side}.json")
            for side in ("real", "compat")}
    logs = {side: proc.communicate(timeout=580)[0].decode(errors="replace")
            for side, (proc, _) in runs.items()}
    results = {}
    for side, (_, out) in runs.items():
        assert out.exists(), f"the {side} run wrote no results:\n{logs[side][-4000:]}"
        results[side] = json.loads(out.read_text())
    real, compat = results["real"]["outcomes"], results["compat"]["outcomes"]
    broken = {_file(n): r for n, r in results["compat"]["collection_errors"].items()}
    print(f"\nTorchOpt 0.7.3's tests, a sample per file ({PER_FILE}):")
    print(_table(real, compat, broken))
    assert real, f"the run against TorchOpt ran nothing:\n{logs['real'][-4000:]}"
    assert not results["real"]["collection_errors"], results["real"]["collection_errors"]
    # test_implicit.py's comparisons with JAX/jaxopt skip without JAX: the set-up installs it
    implicit = [o for n, o in real.items() if _file(n) == "test_implicit.py"]
    assert implicit and "skipped" not in implicit, (
        f"test_implicit.py against TorchOpt: {Counter(implicit)}; its JAX comparisons need "
        "jax, jaxlib, jaxopt and optax in .peers/ (scripts/setup_peers.sh installs them)")
    missing = [n for n, o in real.items() if o == "passed" and compat.get(n) != "passed"
               and not any(n.startswith(p) for p in BY_DESIGN)]
    detail = "\n".join(f"  {n}: {compat.get(n, 'not run')}" for n in missing[:40])
    errors = "\n".join(f"{f}:\n{r[-1500:]}" for f, r in list(broken.items())[:3])
    assert not missing, (f"{len(missing)} tests pass on TorchOpt and not on the compat "
                         f"layer:\n{detail}\n{errors}\n{logs['compat'][-6000:]}")


def test_the_sample_runs_every_function_with_every_parameter_value() -> None:
    from torchopt_suite import plugin

    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    grid = [Item(f"f.py::test_a[dtype(torch.float64)-lr({lr})-steps({k})-f(<function g at "
                 f"0x{k:x}>)]") for lr in (0.1, 0.01) for k in (20, 50, 100)]
    others = [Item(f"f.py::test_b[a{a}-b{b}-{c}]") for a in range(3) for b in range(5)
              for c in (True, False)] + [Item("f.py::test_c")]
    chosen = plugin._sample(grid + others, 12)  # coverings of 3 + 5 + 1 tests, 3 more
    ids = {t.nodeid for t in chosen}
    assert len(chosen) == 12 and len(ids) == 12
    for group in (grid, others[:30]):
        wanted = set().union(*(plugin._values(t) for t in group))
        assert wanted == set().union(*(plugin._values(t) for t in group if t.nodeid in ids))
    assert "f.py::test_c" in ids
    assert plugin._values(grid[0]) == {(0, "dtype(torch.float64)"), (1, "lr(0.1)"),
                                       (2, "steps(20)"), (3, "f(<function g>)")}
    assert plugin._sample(others, 40) == sorted(others, key=lambda t: t.nodeid)
