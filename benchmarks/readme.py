"""Write the benchmark figures of docs/benchmarks.md and of the README's headline table from a
`metadist bench` run: no figure is pasted by hand.

    python -m benchmarks.readme out/bench/results.json            # rewrite both pages
    python -m benchmarks.readme out/bench/results.json --check    # exit 1 if they would change
    python -m benchmarks.readme out/bench/results.json --merge out/one/results.json
                                    # one benchmark re-run on its own: its sections from there

The README holds one section (``front``: five rows, the strategies against what they
replace); docs/benchmarks.md holds every other. Every figure sits between a pair of markers,

    <!-- bench: NAME -->
    ...
    <!-- /bench: NAME -->

and this module rewrites what is between them from results.json (the suite's output; the
text outside the markers is never touched). It also copies the run's plots into
docs/figures/ (the README shows them) and the results themselves to
docs/figures/bench-results.json, so tests/test_bench.py can check that the README's sections
are exactly what this module makes of them. Every column says what it is: a time in ms or
us, a rate per second, a time ratio (which time over which) or a throughput ratio (which
rate over which), bytes or MiB. A benchmark that failed or was not run leaves its section
saying so; a --quick run is refused (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks.report import ratio_rows, traffic_rows, workloads
from benchmarks.tables import table

README = ROOT / "README.md"
PAGE = ROOT / "docs" / "benchmarks.md"
#: the README's sections; every other section is the benchmarks page's
FRONT = ("front",)
FIGURES = ROOT / "docs" / "figures"
RESULTS_COPY = "bench-results.json"  # beside the figures: the run the README shows
PLOTS = ("step_ratios.png", "memory_per_rank.png", "traffic.png", "ddp_step_time.png",
         "sharded_meta_memory.png")
_BEGIN = re.compile(r"^<!-- bench: (?P<name>[a-z_]+) -->$", re.M)


class ReadmeError(Exception):
    """The README or the results cannot be used as asked (nothing was written)."""


# The benchmarks' own column names, where they leave open what is divided by what: the
# README's label for each. A time ratio is "time A / time B" (< 1: A is faster); a
# throughput ratio is "rate A / rate B" (> 1: A is faster).
RELABEL = {
    # ddp
    "no-comm ms": "no-comm bound ms / step",
    "torch DDP ms": "torch DDP ms / step",
    "metadist ddp ms": "metadist ddp ms / step",
    "ours / torch": "time ratio metadist / torch DDP",
    "torch / bound": "time ratio torch DDP / bound",
    "ours / bound": "time ratio metadist / bound",
    "wire / limit": "bytes ratio wire / limit",
    # zero
    "/ torch ZeRO": "time ratio / torch ZeRO",
    "/ FSDP2": "time ratio / FSDP2",
    "total / ZeRO formula": "memory ratio total / ZeRO formula",
    # precision
    "/ 32-true": "time ratio / 32-true",
    # meta
    "speed-up": "speed-up (time ratio Betty / metadist)",
    "weak-scaling efficiency (t1 / tN)": "weak-scaling efficiency (time ratio t1 / tN)",
    # betty_compat
    "Betty / compat": "time ratio Betty / compat",
    # torchopt_compat, mapreduce
    "x TorchOpt": "throughput ratio / TorchOpt (meta-steps / s)",
    "x TorchOpt throughput": "throughput ratio / TorchOpt (tasks / s)",
    # real_models
    "ours / reference": "time ratio metadist / reference",
    "ours / no-comm bound": "time ratio metadist / no-comm bound",
    "target": "target (time ratio)",
    "total / formula (ddp 16P bytes, zero3 16P/N)":
        "memory ratio total / formula (ddp 16P bytes, zero3 16P/N)",
    # deferred_init
    "deferred / model": "memory ratio deferred peak / model",
    "eager s": "eager build + setup s",
    "deferred s": "deferred build + setup s",
    # compiled
    "eager steps/s": "eager steps / s",
    "compiled steps/s": "compiled steps / s",
    "1st eager s": "first eager step s",
    "1st compiled s": "first compiled step s",
    # sharded_meta
    "within": "bound met",
    # comm
    "comm vs torch": "time ratio comm / torch - 1",
    "debug vs comm": "time ratio debug / comm - 1",
}
# Per benchmark where one name means different things in different benchmarks.
RELABEL_IN = {
    ("compiled", "speed-up"): "throughput ratio compiled / eager (steps / s)",
    ("comm", "speed-up"): "speed-up (time ratio one-by-one / fused)",
    ("launch_start", "speed-up"): "speed-up (time ratio spawned / forked)",
    **{("affordable_meta", c): f"{c} MiB" for c in (
        "ddp N=1", "ddp N=2", "zero3 N=2", "zero3 N=4", "zero3 N=4 live storages")},
    ("affordable_meta", "zero3 / ddp at N=2"): "memory ratio zero3 / ddp at N=2",
    ("affordable_meta", "zero3 N=4 / one process"): "memory ratio zero3 N=4 / one process",
    ("affordable_meta", "within 1.0"): "target 1.0 met",
    ("affordable_meta", "within 0.35"): "target 0.35 met",
    ("affordable_meta", "within 1.5"): "target 1.5 met",
    ("affordable_meta", "bound without overlap (ddp - its collectives + zero3's) / ddp"):
        "bound without overlap: time ratio (ddp - its collectives + zero3's) / ddp",
    **{("affordable_meta", f"{p} cores busy"): f"{p} cores busy: CPU time ratio over cores x "
       "wall time" for p in ("ddp", "zero3")},
    ("affordable_meta", "CPU ratio zero3 / ddp"): "CPU time ratio zero3 / ddp",
    ("affordable_meta", "CPU bound (ddp - its collectives + zero3's) / ddp"):
        "CPU bound: CPU time ratio (ddp - its collectives + zero3's) / ddp",
}
# A column is labelled when it names a unit, a rate, or the kind of ratio it is.
_UNITS = re.compile(r"(\bms\b|\bus\b|\bs\b|MiB|GB/s|/ s\b|/ it\b|/ step\b|/ meta-step\b|"
                    r"time ratio|throughput ratio|memory ratio|bytes ratio|speed-up|"
                    r"efficiency|max \||\bsame\b|target|\bmet\b)")
# Columns that are names, counts or settings, not measurements.
_PLAIN = {"workload", "configuration", "reference", "strategy", "format", "precision",
          "ranks", "world", "program", "allocator", "hypergradient", "hypergradient (inner Config)",
          "implementation", "model", "payload", "primitive", "full buffer", "by op",
          "all-reduce MiB", "256 x 4 KiB all-reduce", "per-rank batch", "global batch",
          "collectives / step", "collectives / it", "metadist collectives / it",
          "iterations compared", "same init", "max loss diff", "loss after training",
          "per rank MiB (rank 0 / 1 / ...)", "fast weights", "collective",
          "calls / meta-step", "calls / meta-step by the formula",
          "growth bytes per parameter", "largest model G parameters"}


def label(bench: str, column: str) -> str:
    """The README's name for ``column`` of ``bench``; raises for one that does not say what
    it measures (a new column of a benchmark needs an entry in RELABEL)."""
    name = RELABEL_IN.get((bench, column), RELABEL.get(column, column))
    if name not in _PLAIN and not _UNITS.search(name):
        raise ReadmeError(f"column {column!r} of benchmark {bench!r} does not say what it is "
                          "(a unit, a rate, or which time or throughput ratio): give it a "
                          "label in benchmarks/readme.py RELABEL")
    return name


# ----- what each section shows ------------------------------------------------------------

def _entry(results: dict[str, Any], bench: str) -> dict[str, Any] | None:
    entry = results.get("benchmarks", {}).get(bench)
    return entry if entry and entry.get("status") == "ok" else None


def _missing(results: dict[str, Any], bench: str) -> list[str]:
    entry = results.get("benchmarks", {}).get(bench)
    if entry is None:
        return [f"*Not measured in this run: `{bench}` was not run (`metadist bench --only` "
                "left it out).*"]
    first = (entry.get("error") or "failed").splitlines()[0].split("; last lines")[0]
    return [f"*Not measured in this run: `{bench}` failed ({first}); see the run's "
            "report.*"]


def _command(entry: dict[str, Any]) -> str:
    """The command as a reader would type it (the suite's --json path and interpreter left
    out)."""
    words = entry["command"].split()
    keep, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in ("--json", "--plot"):
            skip = True
            continue
        keep.append(w)
    if keep and keep[0].endswith("python"):
        keep[0] = "python"
    return " ".join(keep)


def _tables(results: dict[str, Any], bench: str,
            keys: Callable[[str], bool] = lambda key: True,
            notes: bool = False, skip_notes: tuple[str, ...] = ()) -> list[str]:
    """The benchmark's tables whose key ``keys`` accepts, each group under the heading the
    benchmark printed (its settings), relabelled; with ``notes``, the notes it printed there
    (but those starting with one of ``skip_notes``: explanations of a column the README
    relabels)."""
    entry = _entry(results, bench)
    if entry is None:
        return _missing(results, bench)
    result = entry["result"]
    load = entry.get("loadavg")
    when = f" (1-minute load average as it ended: {load[0]:.1f})" if load else ""
    run = entry.get("run")
    if run:  # merged from a run of its own (--merge)
        code = f", commit {run['commit']}" if run.get("commit") else ""
        when += (f", measured in a separate run (`{run['command']}`, {run['date'][:10]}"
                 f"{code}{' with uncommitted changes' if run.get('dirty') else ''})")
    lines = [f"`{_command(entry)}`{when}:", ""]
    shown = [t for t in result["tables"] if keys(t["key"])]
    titles = list(dict.fromkeys(t["title"] for t in shown))
    for title in titles:
        if title:
            lines += [f"*{title}*", ""]
        for t in shown:
            if t["title"] == title:
                lines += [table([label(bench, c) for c in t["columns"]], t["rows"]), ""]
        if notes:
            lines += [f"{n['text'].strip()}\n" for n in result.get("notes", [])
                      if n["title"] == title and not n["text"].startswith(skip_notes)]
    lines += [f"*Skipped in this run: {why}*\n" for why in result.get("skipped", [])]
    return lines


def _met(value: float, target: float) -> str:
    return "yes" if value <= target else "**no**"


# (metadist configuration, reference, the target step-time ratio): the README's targets.
TARGETS = (("metadist ddp", "torch DDP", 1.0),
           ("metadist zero1", "torch ZeRO (DDP + ZeroRedundancyOptimizer)", 1.0),
           ("metadist zero2", "torch ZeRO (DDP + ZeroRedundancyOptimizer)", 1.0),
           ("metadist zero3", "torch FSDP2 fully_shard", 0.6))


def section_machine(results: dict[str, Any]) -> list[str]:
    m, s = results["machine"], results["settings"]
    peers = results.get("peers", {})
    have = [k for k, v in peers.get("installed", {}).items() if v]
    device = m.get("device") or "unknown"
    if m.get("backend"):
        device += f", {m['backend']}"
    load = [e["loadavg"][0] for e in results["benchmarks"].values() if e.get("loadavg")]
    start = m.get("loadavg")
    load_text = ""
    if start or load:
        parts = []
        if start:
            parts.append(f"{start[0]:.1f} at its start")
        if load:
            parts.append(f"{min(load):.1f}-{max(load):.1f} after each benchmark, whose own "
                         "ranks count in it")
        load_text = (f" The 1-minute load average was {' and '.join(parts)} (the machine "
                     "is shared: other work competed for the cores).")
    code = ""
    if m.get("commit"):
        code = (f" of commit {m['commit']}"
                f"{' with uncommitted changes' if m.get('dirty') else ''}")
    separate = [name for name, e in results["benchmarks"].items() if e.get("run")]
    if separate:
        load_text += (f" The sections of {', '.join(separate)} come from separate runs, "
                      "each saying which.")
    return [f"The figures below come from one `{results['command']}` run{code} of "
            f"{m['date'][:10]} ({m['date']}) on {m.get('cpu') or 'an unknown CPU'} "
            f"({m.get('cpu_count')} cores; {device}), world size {s.get('world') or 2} "
            f"unless a table says otherwise, torch {m.get('torch')}, Python "
            f"{m.get('python')}; peer anchors from `.bench/`: {', '.join(have) or 'none'}. "
            f"The suite took {results.get('seconds', 0):.0f} s.{load_text}", ""]


def section_headline(results: dict[str, Any]) -> list[str]:
    rows = ratio_rows(results)
    if not rows:
        return [*_missing(results, "ddp"), *_missing(results, "zero")]
    lines = [table(["workload", "configuration", "reference", "configuration ms / step",
                    "reference ms / step", "time ratio configuration / reference"], rows), ""]
    targets = []
    # The targets are the ddp and zero benchmarks' (real_models states its own, per row).
    own = {name for bench, name, _ in workloads(results) if bench in ("ddp", "zero")}
    for workload in (w for w in dict.fromkeys(r[0] for r in rows) if w in own):
        for config, ref, target in TARGETS:
            got = next((r[5] for r in rows if r[:3] == (workload, config, ref)), None)
            if got is not None:
                targets.append((workload, config, ref, f"<= {target:g}", got,
                                _met(got, target)))
    if targets:
        lines += ["Targets (step-time ratio to the implementation each strategy replaces):",
                  "", table(["workload", "configuration", "reference", "target (time ratio)",
                             "measured (time ratio)", "met"], targets), ""]
    return lines


#: the README's rows: (configuration, reference), each from the largest workload run
FRONT_ROWS = (("metadist ddp", "torch DDP"),
              ("metadist zero1", "torch ZeRO (DDP + ZeroRedundancyOptimizer)"),
              ("metadist zero2", "FairScale OSS + ShardedDDP"),
              ("metadist zero3", "torch FSDP2 fully_shard"),
              ("metadist zero3", "no-comm bound"))
_LARGEST_FIRST = ("gpt2", "transformer", "mlp")


def section_front(results: dict[str, Any]) -> list[str]:
    """Five rows for the README: each strategy's step time over the implementation it
    replaces, on the largest workload that ran both."""
    rows = ratio_rows(results)
    if not rows:
        return [*_missing(results, "ddp"), *_missing(results, "zero")]
    order = {w: i for i, w in enumerate(_LARGEST_FIRST)}
    picked = []
    for config, ref in FRONT_ROWS:
        found = sorted((r for r in rows if r[1:3] == (config, ref)),
                       key=lambda r: order.get(r[0], len(order)))
        if found:
            picked.append(found[0])
    return [table(["workload", "configuration", "reference", "configuration ms / step",
                   "reference ms / step", "time ratio configuration / reference"], picked)]


def section_zero(results: dict[str, Any]) -> list[str]:
    lines = _tables(results, "zero")
    rows = traffic_rows(results)
    if rows and _entry(results, "zero") is not None:
        lines += ["*Traffic of every strategy's step (barriers of the timing harness left "
                  "out)*", "",
                  table(["workload", "configuration", "collectives / step", "by op",
                         "wire MiB (ring model)", "ring limit MiB",
                         label("zero", "wire / limit")], rows), ""]
    return lines


def _ratio_range(values: Iterable[float]) -> str:
    vs = sorted(values)
    return f"{vs[0]:.2f}" if vs[0] == vs[-1] else f"{vs[0]:.2f}-{vs[-1]:.2f}"


def section_meta(results: dict[str, Any]) -> list[str]:
    lines = _tables(results, "meta", notes=True)
    entry = _entry(results, "meta")
    betty = entry["result"].get("data", {}).get("betty") if entry else None
    if betty:
        speed = [r["speedup"] for r in betty if r.get("speedup") is not None]
        if speed:
            lines += [f"Speed-up over Betty (Betty's time / metadist's): {_ratio_range(speed)}; "
                      f"the target (at least 1) is {'met' if min(speed) >= 1 else '**not met**'}"
                      ".", ""]
    return lines


def section_betty_compat(results: dict[str, Any]) -> list[str]:
    lines = _tables(results, "betty_compat", notes=True)
    entry = _entry(results, "betty_compat")
    one = entry["result"].get("data", {}).get("one_process") if entry else None
    ratios = [r["betty_over_compat"] for r in one or [] if r.get("betty_over_compat")]
    if ratios:
        lines += [f"Betty's time over the drop-in's: {_ratio_range(ratios)}; the target (at "
                  f"least 1) is {'met' if min(ratios) >= 1 else '**not met**'}.", ""]
    return lines


def _simple(bench: str, notes: bool = False, skip_notes: tuple[str, ...] = ()
            ) -> Callable[[dict[str, Any]], list[str]]:
    return lambda results: _tables(results, bench, notes=notes, skip_notes=skip_notes)


# README section name -> what it shows, in README order.
SECTIONS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "front": section_front,
    "machine": section_machine,
    "headline": section_headline,
    "ddp": _simple("ddp"),
    "zero": section_zero,
    "precision": _simple("precision"),
    "checkpoint": _simple("checkpoint"),
    "meta": section_meta,
    "betty_compat": section_betty_compat,
    # its "(x TorchOpt: ...)" note explains the column relabelled here
    "torchopt_compat": _simple("torchopt_compat", notes=True, skip_notes=("(x TorchOpt:",)),
    "real_models": _simple("real_models", notes=True),
    "deferred_init": _simple("deferred_init"),
    "compiled": _simple("compiled"),
    "mapreduce": _simple("mapreduce"),
    "sharded_meta": _simple("sharded_meta", notes=True),
    "affordable_meta": _simple("affordable_meta", notes=True),
    "maml_overhead": _simple("maml_overhead"),
    "launch_start": _simple("launch_start"),
    "comm": _simple("comm", notes=True),
}


def sections(results: dict[str, Any]) -> dict[str, str]:
    """Every section's Markdown (without its markers)."""
    if results.get("settings", {}).get("quick"):
        raise ReadmeError("these results come from `metadist bench --quick` (tiny models, 2 "
                          "steps): their figures mean nothing; run `make bench` for the README")
    return {name: "\n".join(make(results)).strip() + "\n" for name, make in SECTIONS.items()}


def rewrite(text: str, generated: dict[str, str], names: Sequence[str] | None = None) -> str:
    """``text`` with the body of every ``<!-- bench: NAME -->`` section replaced. Every
    section of ``generated`` (or of ``names``) must be in the text exactly once, and every
    section in the text must be known."""
    found = [m.group("name") for m in _BEGIN.finditer(text)]
    unknown = sorted(set(found) - set(generated))
    if unknown:
        raise ReadmeError(f"the README has bench sections this module does not make: "
                          f"{', '.join(unknown)}")
    for name in names or list(generated):
        if found.count(name) != 1:
            raise ReadmeError(f"the README must hold `<!-- bench: {name} -->` ... "
                              f"`<!-- /bench: {name} -->` exactly once (found "
                              f"{found.count(name)})")

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        return f"<!-- bench: {name} -->\n\n{generated[name]}\n<!-- /bench: {name} -->"

    out, count = re.subn(r"^<!-- bench: (?P<name>[a-z_]+) -->\n.*?^<!-- /bench: (?P=name) -->$",
                         replace, text, flags=re.M | re.S)
    if count != len(found):
        raise ReadmeError("a `<!-- bench: NAME -->` marker has no matching "
                          "`<!-- /bench: NAME -->` after it")
    return out


def current(text: str) -> dict[str, str]:
    """The README's sections as they stand (bodies, markers left out)."""
    return {m.group("name"): m.group("body").strip("\n") + "\n" for m in re.finditer(
        r"^<!-- bench: (?P<name>[a-z_]+) -->\n(?P<body>.*?)^<!-- /bench: (?P=name) -->$",
        text, flags=re.M | re.S)}


def merged(results: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """``results`` with the benchmarks of ``part`` (a run of some benchmarks of their own,
    `metadist bench --only ...`) in place of its own, each marked with that run."""
    if part.get("settings", {}).get("quick"):
        raise ReadmeError("a --merge run comes from `metadist bench --quick`: its figures "
                          "mean nothing")
    out: dict[str, Any] = json.loads(json.dumps(results))
    m = part["machine"]
    for name, entry in part["benchmarks"].items():
        out["benchmarks"][name] = {**entry, "run": {
            "command": part["command"], "date": m["date"], "commit": m.get("commit"),
            "dirty": m.get("dirty")}}
    return out


def update(results_path: Path, readme: Path = README, figures: Path | None = FIGURES,
           check: bool = False, merge: Sequence[Path] = (), page: Path = PAGE) -> bool:
    """Rewrite ``readme`` (its :data:`FRONT` sections), ``page`` (every other) and the
    figures from ``results_path`` with the benchmarks of every ``merge`` run in place of its
    own; True if anything changed (with ``check``, nothing is written)."""
    results = json.loads(results_path.read_text())
    for part in merge:
        results = merged(results, json.loads(part.read_text()))
    generated = sections(results)
    targets = {readme: list(FRONT), page: [n for n in generated if n not in FRONT]}
    changed = False
    for path, names in targets.items():
        text = path.read_text()
        new = rewrite(text, {n: generated[n] for n in names}, names)
        if new != text:
            changed = True
            if not check:
                path.write_text(new)
    if check:
        return changed
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        for name in PLOTS:  # a merged run's plot wins over the main run's
            for folder in [*(p.parent for p in reversed(merge)), results_path.parent]:
                if (folder / name).is_file():
                    if (folder / name).resolve() != (figures / name).resolve():
                        shutil.copyfile(folder / name, figures / name)
                    break
        copy = figures / RESULTS_COPY
        if merge or copy.resolve() != results_path.resolve():
            copy.write_text(json.dumps(results, indent=1) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.json written by `metadist bench`")
    ap.add_argument("--readme", default=str(README), help="the README to rewrite")
    ap.add_argument("--page", default=str(PAGE), help="the benchmarks page to rewrite")
    ap.add_argument("--figures", default=str(FIGURES),
                    help="where the README's plots and the results' copy go ('' for nowhere)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if the README differs from the results")
    ap.add_argument("--merge", action="append", default=[], metavar="RESULTS",
                    help="results.json of a run of some benchmarks of their own (`metadist "
                         "bench --only ...`): their sections and plots come from it, saying "
                         "so (repeatable)")
    args = ap.parse_args(argv)
    source = Path(args.results)
    if not source.is_file():
        print(f"{source} does not exist; run `make bench` first", file=sys.stderr)
        return 2
    try:
        changed = update(source, Path(args.readme), Path(args.figures) if args.figures else None,
                         check=args.check, merge=[Path(m) for m in args.merge],
                         page=Path(args.page))
    except ReadmeError as err:
        print(f"benchmarks.readme: {err}", file=sys.stderr)
        return 2
    if args.check:
        if changed:
            print(f"{args.readme} or {args.page}: their benchmark sections differ from "
                  f"{source}", file=sys.stderr)
        return 1 if changed else 0
    print(f"{args.readme}, {args.page}: {'rewritten' if changed else 'already up to date'} "
          f"from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
