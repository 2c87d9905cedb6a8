"""TorchOpt's implicit-MAML example on TorchOpt 0.7.3 and on metadist.compat.torchopt: speed
and numbers.

    python -m benchmarks.torchopt_imaml [--forms module,functional] [--rounds 3] [--tasks 4]
        [--channels 16] [--train-iters 4] [--inner-steps 5] [--json PATH] [--quick]

The program is tests/torchopt_programs/imaml_example.py, a port of TorchOpt's
examples/iMAML/imaml_omniglot.py (``--form module``: ``ImplicitMetaGradientModule`` with
``solve_normal_cg(maxiter=5, atol=0)``, torchopt.SGD inside ``solve``, torchopt.Adam) and
imaml_omniglot_functional.py (``--form functional``: ``custom_root`` over ``functorch.grad``,
torchopt.sgd/adam, ``pytree``) on synthetic Omniglot-shaped tasks (5-way 1-shot, 5 query
shots), written against ``import torchopt``: TorchOpt runs it from ``.bench/`` (``make
bench``), the drop-in through tests/torchopt_programs/as_compat.py. Each run is a process of
its own with one intra-op thread; TorchOpt and the drop-in take turns (``--rounds`` each),
the first meta-step of every run is warm-up, medians over the rest.

Numbers: the example in float32 (its dtype) and the same program in float64, each compared
with TorchOpt's run: the largest difference of any train or test loss, and of the trained
parameters (relative, each parameter's sum).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import PEERS, ROOT
from benchmarks.common import Results, output_args, parse, rotation

PROGRAMS = ROOT / "tests" / "torchopt_programs"
IMPLS = ("TorchOpt 0.7.3", "metadist.compat.torchopt")


def _run(impl: str, form: str, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """One whole run of the example in a process of its own; its JSON log."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "log.json"
        shim = [str(PROGRAMS / "as_compat.py")] if impl == IMPLS[1] else []
        # .bench/ holds TorchOpt, and optree, which the drop-in's pytree needs as TorchOpt's
        # does; for the drop-in the import alias comes first.
        env = {**os.environ, "PYTHONPATH": str(PEERS), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-W", "ignore", *shim, str(PROGRAMS / "imaml_example.py"),
               "--form", form, "--tasks", str(args.tasks), "--channels", str(args.channels),
               "--train-iters", str(args.train_iters), "--inner-steps", str(args.inner_steps),
               "--test-iters", "1", "--epochs", "1", "--dtype", dtype, "--out", str(out)]
        proc = subprocess.run(cmd, cwd=PROGRAMS, env=env, capture_output=True, text=True,
                              check=False, timeout=3000)
        if proc.returncode != 0:
            raise RuntimeError(f"{impl} ({form}, {dtype}) failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


CONV_BIASES = (1, 5, 9)  # conv weight, bias, BatchNorm weight, bias per block; then the head


def _gaps(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[float, float, float]:
    losses = [abs(a[0] - b[0]) for key in ("train", "test")
              for a, b in zip(ours[key], theirs[key], strict=True)]
    params = [abs(a - b) / max(abs(b), 1e-3)
              for a, b in zip(ours["params"], theirs["params"], strict=True)]
    rest = [g for i, g in enumerate(params) if i not in CONV_BIASES]
    return max(losses), max(params), max(rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", default="module,functional")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--train-iters", dest="train_iters", type=int, default=4)
    ap.add_argument("--inner-steps", dest="inner_steps", type=int, default=5)
    output_args(ap)
    args = parse(ap, rounds=1, tasks=2, channels=4, train_iters=2, inner_steps=3)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    with Results("torchopt_imaml", args) as res:
        if not (PEERS / "torchopt").is_dir():
            res.skip("TorchOpt's iMAML example", f"TorchOpt is not installed in {PEERS} "
                     "(make bench)")
            return
        res.heading(f"TorchOpt's iMAML example ({args.tasks} tasks x {args.inner_steps} inner "
                    f"steps per meta-step, 5-way 1-shot, {args.channels} channels, float32), "
                    f"whole runs alternating (medians over {args.rounds} runs x "
                    f"{args.train_iters - 1} meta-steps)")
        steps: dict[tuple[str, str], list[float]] = {(f, i): [] for f in forms for i in IMPLS}
        logs: dict[tuple[str, str, str], dict[str, Any]] = {}
        for r in range(args.rounds):
            for form in forms:
                for impl in rotation(list(IMPLS), r):
                    log = _run(impl, form, args, "float32")
                    steps[(form, impl)] += log["step_s"][1:]
                    logs[(form, impl, "float32")] = log
        rows = []
        for form in forms:
            base = statistics.median(steps[(form, IMPLS[0])])
            for impl in IMPLS:
                ms = statistics.median(steps[(form, impl)])
                rows.append([form, impl, 1e3 * ms, args.tasks / ms, base / ms])
        res.table(["form", "implementation", "ms / meta-step", "tasks / s", "x TorchOpt"], rows,
                  key="speed")
        res.note("(x TorchOpt: meta-steps per second over TorchOpt's)\n")
        res.heading("Numbers: the drop-in's run against TorchOpt's, the same program")
        rows = []
        for form in forms:
            for dtype in ("float32", "float64"):
                if dtype == "float64":
                    for impl in IMPLS:
                        logs[(form, impl, dtype)] = _run(impl, form, args, dtype)
                gaps = _gaps(logs[(form, IMPLS[1], dtype)], logs[(form, IMPLS[0], dtype)])
                rows.append([form, dtype, len(logs[(form, IMPLS[0], dtype)]["train"]), *gaps])
        res.table(["form", "dtype", "meta-steps", "max |loss - TorchOpt|",
                   "max rel |param - TorchOpt|", "same, conv biases left out"], rows,
                  key="numbers")
        res.note("(Losses: every train and test loss of the run. Parameters: each parameter "
                 "tensor's sum, relative. The conv biases feed BatchNorm: their exact gradient "
                 "is zero, their computed one rounding noise that Adam scales to full steps, "
                 "so there the last bits of the two conjugate gradients show)\n")
        res.data = {f"{f}|{i}": steps[(f, i)] for f, i in steps}


if __name__ == "__main__":
    main()
