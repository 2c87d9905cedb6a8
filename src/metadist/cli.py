"""The ``metadist`` command: ``run`` (torch's elastic launcher underneath), ``demo``, ``env``,
``consolidate``, ``bench``."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from metadist.runtime import env as launch_env


def _node_range(nnodes: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` as (min, max), validated."""
    try:
        low, _, high = nnodes.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes {nnodes!r} is not a number of nodes or a range MIN:MAX with "
                         "1 <= MIN <= MAX, e.g. --nnodes 2 or --nnodes 1:4")
    return lo, hi


def _rendezvous_args(ns: argparse.Namespace, lo: int, hi: int, scratch: str) -> list[str]:
    """torchrun's rendezvous options: a file on one node, static for N nodes, c10d's dynamic
    rendezvous for MIN:MAX (which ranks the nodes itself: --node-rank does not apply)."""
    from metadist.runtime.rendezvous import is_loopback

    addr = ns.master_addr or launch_env.LOOPBACK
    port = ns.master_port or launch_env.DEFAULT_PORT
    if lo != hi:
        script = Path(ns.script).stem
        conf = [f"last_call_timeout={ns.last_call}"]
        if ns.rdzv_timeout is not None:
            conf.append(f"join_timeout={ns.rdzv_timeout}")
        host = f"[{addr}]" if ":" in addr else addr  # an IPv6 address
        argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                "--rdzv-id", ns.rdzv_id or f"metadist-{script}", "--rdzv-conf", ",".join(conf)]
        if is_loopback(addr):
            # Every node is on this machine: the workers' MASTER_ADDR (where node 0 serves their
            # store) is then loopback too, so metadist keeps gloo on loopback.
            argv += ["--local-addr", launch_env.LOOPBACK]
        return argv
    if hi == 1 and ns.master_addr is None and ns.master_port is None:
        # One node: the agents meet through a file, not a TCP store (torch's listens on every
        # interface), and rank 0's worker serves the workers' store on loopback.
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", os.path.join(scratch, "rdzv"),
                "--rdzv-conf", "store_type=file", "--rdzv-id", "metadist",
                "--local-addr", launch_env.LOOPBACK]
    argv = ["--node-rank", str(ns.node_rank), "--master-addr", addr, "--master-port", str(port)]
    if ns.rdzv_timeout is not None:
        argv += ["--rdzv-conf", f"timeout={ns.rdzv_timeout}"]
    return argv


# A fresh workers' store per rendezvous round, served by rank 0's worker (metadist's, on
# loopback on one machine) rather than by torch's agent on every interface. It also fixes
# elastic growth: with the agent's shared store, a node joining a running job waits for a key
# the old node 0 never writes (torch 2.13).
_PER_ROUND_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _run(ns: argparse.Namespace) -> int:
    if not os.path.isfile(ns.script):
        # Before any worker starts: otherwise every rank fails the same way and the summary
        # can only say that the origin rank exited.
        print(f"metadist run: script {ns.script!r} does not exist (looked in {os.getcwd()}); "
              "pass the path of a Python file", file=sys.stderr)
        return 2
    if ns.nproc < 1:
        print(f"metadist run: --nproc must be at least 1, got {ns.nproc}", file=sys.stderr)
        return 2
    try:
        lo, hi = _node_range(ns.nnodes)
    except ValueError as err:
        print(f"metadist run: {err}", file=sys.stderr)
        return 2
    if ns.last_call <= 0:
        print(f"metadist run: --last-call must be at least 1 (whole seconds), got "
              f"{ns.last_call}", file=sys.stderr)
        return 2
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # One intra-op thread pool per worker sized to its share of the cores (torchrun would
    # otherwise force 1 thread and warn).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ns.nproc)))
    os.environ.setdefault(_PER_ROUND_STORE, "1")
    if ns.rank_prefix:  # the workers start each line with their rank (runtime/line_output.py)
        os.environ["METADIST_RANK_PREFIX"] = "1"
    with tempfile.TemporaryDirectory(prefix="metadist-run-") as scratch:
        argv = ["--nproc-per-node", str(ns.nproc),
                "--nnodes", f"{lo}:{hi}" if lo != hi else str(hi),
                "--max-restarts", str(ns.max_restarts), *_rendezvous_args(ns, lo, hi, scratch)]
        # Run the user's script through our entry so a failing worker records its traceback
        # and the launcher can show it.
        argv += ["-m", "metadist.runtime.entry", ns.script, *ns.script_args]
        from metadist.runtime.teardown import bounded_teardown

        with bounded_teardown() as killed:
            try:
                torchrun.run(torchrun.parse_args(argv))
            except ChildFailedError as err:
                from metadist.runtime.failures import summarize_run_failure

                # The origin rank once, the ranks that failed as a consequence in one line
                # each (those the launcher had to kill said to be).
                summary = summarize_run_failure(err, ns.script, killed)
                if ns.max_restarts > 0:  # torch elastic raises once no restart is left
                    summary += (f"\n  no restart left: it failed in each of its "
                                f"{ns.max_restarts + 1} attempts (--max-restarts "
                                f"{ns.max_restarts}); the last attempt's failure is above")
                print(summary, file=sys.stderr)
                return 1
            except (Exception, KeyboardInterrupt) as err:
                from metadist.runtime.run_errors import explain

                # The launcher's own failure (port taken, Ctrl-C, SIGTERM): one summary, its
                # traceback in a log file.
                message, code = explain(err, ns.script, ns.master_addr or launch_env.LOOPBACK,
                                        ns.master_port)
                print(message, file=sys.stderr)
                return code
    return 0


DEMOS = ("digits", "collectives")


def _demo(ns: argparse.Namespace) -> int:
    if ns.name not in DEMOS:
        raise SystemExit(f"demo {ns.name!r} is not known; choose one of: {', '.join(DEMOS)}")
    script = str(Path(__file__).parent / "demos" / f"{ns.name}.py")
    run = build_parser().parse_args(["run", "--nproc", str(ns.nproc), script, *ns.extra])
    return _run(run)


def _env(_: argparse.Namespace) -> int:
    from metadist.runtime.report import render

    print(render(), end="")
    return 0


def _consolidate(ns: argparse.Namespace) -> int:
    from metadist.checkpoint import CheckpointError, consolidate

    try:
        out = consolidate(ns.checkpoint, ns.out)
    except CheckpointError as err:
        print(f"metadist consolidate: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): load it with strategy.load, or "
          "torch.load(path, weights_only=True)[name] for the state saved under that name")
    return 0


def _suite_roots() -> list[Path]:
    """Where a source checkout may be: the current directory, then the one this package was
    installed from in editable mode (src/metadist/cli.py -> the checkout)."""
    return [Path.cwd(), Path(__file__).resolve().parents[2]]


def _find_suite(roots: Sequence[Path]) -> Path | None:
    """The first root holding metadist's benchmark suite (benchmarks/suite.py beside
    src/metadist: not some other project's benchmarks)."""
    for root in roots:
        if (root / "benchmarks" / "suite.py").is_file() and (root / "src" / "metadist").is_dir():
            return root
    return None


def _bench(argv: Sequence[str]) -> int:
    """``metadist bench ARGS``: ARGS go to the suite's own parser (benchmarks/suite.py), which
    alone defines the options (``metadist bench --help`` lists them)."""
    # The benchmarks live in the source tree, not in the wheel: run the suite from there, in
    # its own process (each benchmark then in its own, so one failing cannot stop the rest).
    roots = _suite_roots()
    root = _find_suite(roots)
    if root is None:
        looked = " and ".join(str(r) for r in dict.fromkeys(roots))
        print("metadist bench: the benchmark suite (benchmarks/suite.py) was not found in "
              f"{looked}; it ships with the source, not the wheel: run `metadist bench` from a "
              "clone of the metadist repository (or install metadist from one with "
              "`pip install -e .`)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "benchmarks.suite", *argv,
           "--command", shlex.join(["metadist", "bench", *argv])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    # The user's directory: a relative --out means what they typed.
    return subprocess.run(cmd, env=env, check=False).returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metadist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a script on N processes (torch elastic underneath)")
    run.add_argument("--nproc", type=int, default=1, help="processes on this node (default 1)")
    run.add_argument("--nnodes", default="1",
                     help="nodes (default 1), or MIN:MAX for an elastic job: it starts with "
                          "the nodes that met, MIN to MAX (start them within --last-call of "
                          "one another)")
    run.add_argument("--node-rank", type=int, default=0,
                     help="this node's rank (static jobs; elastic jobs rank their nodes)")
    run.add_argument("--master-addr", default=None,
                     help="address of node 0, or of the elastic rendezvous (default loopback)")
    run.add_argument("--master-port", type=int, default=None,
                     help="port of the rendezvous on that node (default 29500; with "
                          "--nnodes 1 and no --master-addr, a free port)")
    run.add_argument("--max-restarts", type=int, default=0, help="restart failed workers K times")
    run.add_argument("--rdzv-timeout", type=int, default=None,
                     help="seconds the nodes may take to meet (default torch's)")
    run.add_argument("--rdzv-id", default=None,
                     help="elastic jobs: a job id shared by all its nodes (default "
                          "metadist-<script name>)")
    run.add_argument("--last-call", type=int, default=10,
                     help="elastic jobs: seconds to wait for more nodes once MIN have joined "
                          "(default 10)")
    run.add_argument("--rank-prefix", action="store_true",
                     help="start every line a worker prints with its rank, e.g. '[rank 3] ' "
                          "(lines arrive whole either way)")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=_run)

    demo = sub.add_parser(
        "demo", help="run a demo on N processes through `metadist run`",
        usage=f"metadist demo [{'|'.join(DEMOS)}] [--nproc N] [demo options, e.g. --strategy ddp]")
    demo.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    demo.set_defaults(handler=_demo)  # other options (--strategy, --epochs...) go to the demo

    env = sub.add_parser("env", help="show launcher, world, backends, device, versions and the "
                                     "environment variables that matter")
    env.set_defaults(handler=_env)

    cons = sub.add_parser(
        "consolidate", help="write a sharded checkpoint as one full-format file (one process)")
    cons.add_argument("checkpoint", help="the sharded checkpoint directory (strategy.save)")
    cons.add_argument("out", help="the file to write")
    cons.set_defaults(handler=_consolidate)

    # Parsed by the suite itself (see _bench); listed here for `metadist --help`.
    sub.add_parser("bench", add_help=False,
                   help="run the benchmark suite of a source checkout and write a report with "
                        "plots (OUT/report.md, OUT/results.json, OUT/*.png); "
                        "`metadist bench --help` for its options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if args[:1] == ["bench"]:
        return _bench(args[1:])
    if args[:1] == ["demo"]:
        # `metadist demo [name] [--nproc N] [anything for the demo, e.g. --strategy zero2]`
        rest = args[1:]
        name = rest.pop(0) if rest and not rest[0].startswith("-") else DEMOS[0]
        ns, extra = parser.parse_known_args(["demo", *rest])
        ns.name, ns.extra = name, extra
    else:
        ns = parser.parse_args(args)
    code: int = ns.handler(ns)
    return code


if __name__ == "__main__":
    sys.exit(main())
