"""Write the suite's results as OUT/report.md with plots (matplotlib, Agg backend).

    python -m benchmarks.report OUT/results.json   # re-render a report from its results

Plots: step-time ratios (each metadist strategy over torch's implementation and over the
no-communication bound, per workload), per-rank memory by strategy (stacked P/G/O against
the ZeRO formula) and bytes per step against the ring limit. Every table the benchmarks
printed follows, with failures and skipped anchor rows said where they happened.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.tables import table

MIB = 2**20
# One colour per reference, the same in every plot.
COLOURS = {"torch DDP": "#4c72b0", "torch ZeRO (DDP + ZeroRedundancyOptimizer)": "#55a868",
           "torch FSDP2 fully_shard": "#c44e52", "FairScale OSS + ShardedDDP": "#8172b2",
           "no-comm bound": "#999999"}  # also the order of the bars
SHORT = {"torch ZeRO (DDP + ZeroRedundancyOptimizer)": "torch ZeRO",
         "torch FSDP2 fully_shard": "FSDP2", "FairScale OSS + ShardedDDP": "FairScale"}


def _short(name: str) -> str:
    return SHORT.get(name, name.removeprefix("metadist "))


def workloads(results: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(benchmark, workload, data) for the benchmarks that ran with per-workload data
    (ddp and zero), in run order."""
    for bench, entry in results.get("benchmarks", {}).items():
        if entry.get("status") != "ok":
            continue
        for name, data in entry["result"].get("data", {}).get("workloads", {}).items():
            yield bench, name, data


def _by_workload(results: dict[str, Any]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for bench, name, data in workloads(results):
        out.setdefault(name, []).append((bench, data))
    return out


# What each metadist strategy is measured against in the headline (results.json and the
# benchmarks' own tables keep every pair): the implementation it replaces, and the bound.
_ZERO12 = ("torch ZeRO (DDP + ZeroRedundancyOptimizer)", "FairScale OSS + ShardedDDP")
REFERENCES = {"metadist ddp": ("torch DDP",),
              "metadist zero1": (*_ZERO12, "metadist zero1 overlap_param_gather"),
              "metadist zero2": (*_ZERO12, "metadist zero2 overlap_param_gather"),
              "metadist zero3": ("torch FSDP2 fully_shard",)}
BOUND = "no-comm bound"


def ratio_rows(results: dict[str, Any]) -> list[tuple[str, str, str, float, float, float]]:
    """(workload, metadist configuration, reference, ms, reference ms, ratio): ours over
    the torch implementation it replaces and over the bound measured in the same run."""
    rows = []
    for _, name, data in workloads(results):
        configs = data["configs"]
        for r in data["ratios"]:
            if (configs[r["config"]]["role"] == "metadist" and r["ratio"] is not None
                    and r["reference"] in (*REFERENCES.get(r["config"], ()), BOUND)):
                rows.append((name, r["config"], r["reference"], configs[r["config"]]["ms"],
                             configs[r["reference"]]["ms"], r["ratio"]))
    return rows


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return path


def _subplots(plt: Any, count: int, width: float = 5.5) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, count, figsize=(width * count, 4.2), squeeze=False)
    return fig, list(axes[0])


def plot_ratios(results: dict[str, Any], path: Path) -> Path | None:
    """Grouped bars per workload: for each metadist strategy its step time over each
    reference (lower is better; 1 = as fast as the reference)."""
    rows = ratio_rows(results)
    if not rows:
        return None
    plt = _pyplot()
    names = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = _subplots(plt, len(names))
    for ax, name in zip(axes, names, strict=True):
        mine = [r for r in rows if r[0] == name]
        configs = list(dict.fromkeys(r[1] for r in mine))
        refs = [ref for ref in COLOURS if any(r[2] == ref for r in mine)]
        width = 0.8 / len(refs)
        labelled: set[str] = set()
        for j, ref in enumerate(refs):
            for i, config in enumerate(configs):
                value = next((r[5] for r in mine if r[1] == config and r[2] == ref), None)
                if value is None:
                    continue
                x = i + (j - (len(refs) - 1) / 2) * width
                ax.bar(x, value, width, color=COLOURS[ref],
                       label=None if ref in labelled else _short(ref))
                labelled.add(ref)
                ax.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(configs)), [_short(c) for c in configs], rotation=20,
                      ha="right")  # "zero1 overlap_param_gather" and its neighbours
        ax.set_ylim(0, 1.4 * max(1.0, *(r[5] for r in mine)))  # room for the legend
        ax.set_title(f"{name}: metadist step time / reference")
        ax.set_ylabel("ratio (lower is faster)")
        ax.legend(fontsize=7, title="reference", title_fontsize=7, loc="upper center",
                  ncol=3)
    return _save(plt, fig, path)


def _memory(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: data["configs"] for _, name, data in workloads(results)
            if any("memory" in c for c in data["configs"].values())}


def plot_memory(results: dict[str, Any], path: Path) -> Path | None:
    """Stacked parameters / gradients / optimizer state per rank for every configuration,
    with the ZeRO formula of each metadist stage marked."""
    per_workload = _memory(results)
    if not per_workload:
        return None
    plt = _pyplot()
    fig, axes = _subplots(plt, len(per_workload), width=6.5)
    for ax, (name, configs) in zip(axes, per_workload.items(), strict=True):
        shown = {k: c for k, c in configs.items() if "memory" in c}
        xs = range(len(shown))
        bottom = [0.0] * len(shown)
        for part, colour in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optim", "#55a868")):
            heights = [c["memory"][part] / MIB for c in shown.values()]
            ax.bar(xs, heights, 0.6, bottom=bottom, color=colour, label=part)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        labelled = False
        for x, c in zip(xs, shown.values(), strict=True):
            if c.get("zero_formula_bytes"):
                ax.hlines(c["zero_formula_bytes"] / MIB, x - 0.4, x + 0.4, colors="black",
                          linewidth=2, label=None if labelled else "ZeRO formula")
                labelled = True
        ax.set_xticks(list(xs), [_short(k) for k in shown], rotation=30, ha="right")
        ax.set_ylabel("MiB per rank")
        ax.set_title(f"{name}: per-rank state after a step")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _by_op(traffic: dict[str, Any]) -> tuple[int, str]:
    """Calls per step and their split by op, leaving out barriers (ddp's counted step
    includes the two of the timing harness: they are not the strategy's)."""
    ops = {op: s["calls"] for op, s in traffic.get("ops", {}).items() if op != "barrier"}
    if not ops:
        return traffic["calls"], "-"
    return sum(ops.values()), ", ".join(f"{n} {op}" for op, n in ops.items())


def traffic_rows(results: dict[str, Any]) -> list[tuple[str, str, int, str, float, float,
                                                         float]]:
    """(workload, configuration, calls, calls by op, wire MiB, ring-limit MiB, wire / limit)
    per step."""
    rows = []
    for _, name, data in workloads(results):
        for config, c in data["configs"].items():
            t = c.get("traffic")
            if t:
                rows.append((name, config, *_by_op(t), t["wire_bytes"] / MIB,
                             t["ring_limit_bytes"] / MIB, t["wire_over_limit"]))
    return rows


def plot_traffic(results: dict[str, Any], path: Path) -> Path | None:
    """Bytes one rank sends per step (ring model) against the ring limit."""
    rows = traffic_rows(results)
    if not rows:
        return None
    plt = _pyplot()
    names = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = _subplots(plt, len(names), width=4.5)
    for ax, name in zip(axes, names, strict=True):
        mine = [r for r in rows if r[0] == name]
        xs = range(len(mine))
        ax.bar(xs, [r[4] for r in mine], 0.6, color="#dd8452", label="wire MiB / step")
        for x, r in zip(xs, mine, strict=True):
            ax.hlines(r[5], x - 0.4, x + 0.4, colors="black", linewidth=2,
                      label="ring limit" if x == 0 else None)
            ax.text(x, r[4], f"{r[6]:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [_short(r[1]) for r in mine])
        ax.set_ylim(0, 1.3 * max(max(r[4], r[5]) for r in mine))  # room for the legend
        ax.set_ylabel("MiB sent per rank per step")
        ax.set_title(f"{name}: traffic vs ring limit")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_sharded_meta(results: dict[str, Any], path: Path) -> Path | None:
    """Per-rank peak growth of one second-order meta-step against N: whole fast weights
    (ddp, zero3 gathered) and shard fast weights (zero3), with issue 28's bound."""
    entry = results.get("benchmarks", {}).get("sharded_meta")
    if not entry or entry.get("status") != "ok":
        return None
    rows = entry["result"].get("data", {}).get("memory", [])
    if not rows:
        return None
    plt = _pyplot()
    fig, axes = _subplots(plt, 1, width=6.5)
    ax = axes[0]
    for (strategy, path_kind), colour in ((("ddp", "gathered"), "#4c72b0"),
                                          (("zero3", "gathered"), "#dd8452"),
                                          (("zero3", "sharded"), "#55a868")):
        mine = [r for r in rows if (r["strategy"], r["path"]) == (strategy, path_kind)
                and r["ranks"].isdigit()]
        ax.plot([int(r["ranks"]) for r in mine], [r["live_mib"][1] for r in mine], "o-",
                color=colour, label=f"{strategy}, {path_kind} fast weights")
    bound = [r for r in rows if r["strategy"] == "zero3" and r["path"] == "sharded"
             and r["ranks"].isdigit()]
    ax.plot([int(r["ranks"]) for r in bound], [r["bound_mib"] for r in bound], "k--",
            linewidth=1, label="bound: 1.2 x ddp(N=1) / N + 2 units")
    hsdp = [r for r in rows if r["strategy"] == "hsdp"]
    if hsdp:
        ax.plot([4], [hsdp[0]["live_mib"][1]], "s", color="#c44e52",
                label="hsdp 2 x 2, sharded")
    ax.set_xticks([1, 2, 4])
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MiB per rank (live storages, peak growth)")
    ax.set_title("second-order meta-step: per-rank peak")
    ax.set_ylim(0, None)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


PLOTS = (("step-time ratios", "step_ratios.png", plot_ratios),
         ("memory per rank", "memory_per_rank.png", plot_memory),
         ("traffic per step", "traffic.png", plot_traffic),
         ("second-order meta-step memory per rank", "sharded_meta_memory.png",
          plot_sharded_meta))


def _header(results: dict[str, Any]) -> list[str]:
    m, s = results["machine"], results["settings"]
    device = m.get("device") or "unknown (no benchmark finished)"
    if m.get("backend"):
        device += f" ({m['backend']})"
    gpu = _on_gpu(results)
    if m.get("device") == "cuda":
        device += (f": {m.get('gpus')} x {m.get('cuda_device')}, CUDA {m.get('cuda')}, one GPU "
                   f"per rank, for {', '.join(gpu)}; the other benchmarks on the CPU (gloo)")
    elif m.get("cuda_available"):
        device += f"; CUDA visible: {m.get('cuda_device')} (unused: the benchmarks run on CPU)"
    world = s["world"] or (f"one rank per GPU for {', '.join(gpu)}, else 2" if gpu else 2)
    rows = [("command", f"`{results['command']}`"), ("date", m["date"]),
            ("mode", "quick (tiny models, 2 steps: checks the pipeline, the figures mean "
                     "nothing)" if s["quick"] else "full (the settings of the README's tables; "
                                                   "each command is below)"),
            ("world size", f"{world} (meta and betty_compat: 1 and 2, mapreduce: 2, "
                           "torchopt_compat: 2 and 4, always)"),
            ("torch", m["torch"]), ("metadist", m["metadist"]), ("python", m["python"]),
            ("platform", m["platform"]), ("CPU", m["cpu"]), ("CPU count", m["cpu_count"]),
            ("device", device), ("suite wall time", f"{results.get('seconds', 0):.0f} s")]
    return ["# metadist benchmark report", "", table(["", ""], rows), ""]


def _peers_note(results: dict[str, Any]) -> list[str]:
    peers = results["peers"]
    skipped = [f"- **{name}**: {why}" for name, e in results["benchmarks"].items()
               if e["status"] == "ok" for why in e["result"].get("skipped", [])]
    if not peers["present"]:
        head = (f"Peer libraries: `{peers['dir']}` does not exist, so the FairScale, Betty and "
                "TorchOpt anchor rows are skipped (`make bench` installs them there).")
    else:
        have = [k for k, v in peers["installed"].items() if v]
        head = f"Peer libraries in `{peers['dir']}`: {', '.join(have) or 'none'}."
    lines = [head, ""]
    if skipped:
        lines += ["Skipped anchor rows:", "", *skipped, ""]
    return lines


def _on_gpu(results: dict[str, Any]) -> list[str]:
    """The benchmarks whose ranks computed on a GPU."""
    return [name for name, e in results["benchmarks"].items()
            if e.get("result", {}).get("environment", {}).get("device") == "cuda"]


def _summary(results: dict[str, Any]) -> list[str]:
    gpu = _on_gpu(results)
    rows = []
    for name, e in results["benchmarks"].items():
        where = [("cuda" if name in gpu else "cpu")] if gpu else []  # a column once mixed
        rows.append((name, e["status"], *where, f"{e['seconds']:.0f}", f"`{e['command']}`"))
    heads = ["benchmark", "status", *(["device"] if gpu else []), "wall s", "command"]
    return ["## Benchmarks run", "", table(heads, rows), ""]


def _headline(results: dict[str, Any], figures: list[tuple[str, str]]) -> list[str]:
    lines = []
    rows = ratio_rows(results)
    if rows:
        lines += ["## Step-time ratios", "",
                  "Each metadist strategy's median step time over torch's implementation and "
                  "over the no-communication bound, measured in the same processes, taking "
                  "turns (lower is faster).", "",
                  table(["workload", "configuration", "reference", "ms / step", "reference ms",
                         "ratio"], rows), ""]
    traffic = traffic_rows(results)
    if traffic:
        lines += ["## Traffic per step", "",
                  "Bytes a rank sends per step on average under comm's ring model "
                  "(all_reduce 2B(N-1)/N, every other collective B(N-1)/N of its full "
                  "buffer) against the ring limit 2P(N-1)/N (3P(N-1)/N for zero3); barriers "
                  "left out. zero1 moves 3P(N-1)/N by design (a gradient all-reduce, then the "
                  "owners' broadcast of updated parameters); zero2 reduces gradients to their "
                  "owners instead and stays at the limit.", "",
                  table(["workload", "configuration", "collectives / step", "by op",
                         "wire MiB (ring model)", "ring limit MiB", "wire / limit"], traffic),
                  ""]
    if figures:
        lines += ["## Plots", ""]
        lines += [f"![{title}]({file})\n" for title, file in figures]
    return lines


def _section(name: str, entry: dict[str, Any]) -> list[str]:
    lines = [f"## {name}", "", f"`{entry['command']}` ({entry['seconds']:.0f} s)", ""]
    if entry["status"] != "ok":
        lines += [f"**Failed**: {entry['error'].splitlines()[0]}", "", "```",
                  *entry["error"].splitlines()[1:], "```", ""]
        if not entry.get("result", {}).get("tables"):
            return lines
        lines += ["What it measured before it failed:", ""]
    result = entry["result"]
    tables, notes = result["tables"], result.get("notes", [])
    for title in dict.fromkeys(item["title"] for item in [*tables, *notes]):
        lines += [f"### {title}", ""] if title else []
        lines += [f"{n['text']}\n" for n in notes if n["title"] == title]
        lines += [f"{table(t['columns'], t['rows'])}\n" for t in tables if t["title"] == title]
    lines += [f"Skipped: {why}\n" for why in result.get("skipped", [])]
    return lines


def render(results: dict[str, Any], figures: list[tuple[str, str]]) -> str:
    """The report's Markdown; ``figures`` are (title, file name beside the report)."""
    lines = [*_header(results), *_peers_note(results), *_summary(results),
             *_headline(results, figures)]
    for name, entry in results["benchmarks"].items():
        lines += _section(name, entry)
    return "\n".join(lines).rstrip() + "\n"


def write_report(results: dict[str, Any], out: Path) -> Path:
    """Draw the plots the results allow, then write OUT/report.md embedding them."""
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for title, file, draw in PLOTS:
        (out / file).unlink(missing_ok=True)  # a stale plot would contradict the tables
        if draw(results, out / file) is not None:
            figures.append((title, file))
    for name, entry in results["benchmarks"].items():  # a benchmark's own plots, if here
        if entry["status"] != "ok":
            continue
        for title, file in entry["result"].get("data", {}).get("plots", {}).items():
            if Path(file).is_file() and Path(file).resolve().parent == out.resolve():
                figures.append((f"{name}: {title}", Path(file).name))
    path = out / "report.md"
    path.write_text(render(results, figures))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.json written by the suite")
    ap.add_argument("--out", default=None, help="directory for the report (default: beside it)")
    args = ap.parse_args()
    source = Path(args.results)
    if not source.is_file():
        print(f"{source} does not exist; run `metadist bench` first", file=sys.stderr)
        return 2
    print(write_report(json.loads(source.read_text()), Path(args.out or source.parent)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
