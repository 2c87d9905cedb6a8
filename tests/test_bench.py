"""`metadist bench`: the suite runs benchmarks in their own processes and writes a report with
plots. Checks the pipeline and the report's content, never timings (those belong in the
benchmarks themselves)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from metadist import cli

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the benchmarks live in the checkout, not in the package

from benchmarks import report, suite  # noqa: E402

NUMBER = r"-?\d[\d.]*(?:e[+-]?\d+)?"


def _valid_png(path: Path) -> None:
    """A real image, not an empty or truncated file: decodes, and has pixels to show."""
    import matplotlib.image

    assert path.is_file(), f"{path.name} was not written"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert path.stat().st_size > 10_000, f"{path.name} is suspiciously small"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 300 and height > 200


def _ratio(text: str, workload: str, config: str, reference: str) -> float:
    """The ratio column of the report's step-time ratio row for (workload, config, ref)."""
    row = re.search(rf"^\| {workload} \| {re.escape(config)} \| {re.escape(reference)} \| "
                    rf"{NUMBER} \| {NUMBER} \| ({NUMBER}) \|$", text, re.M)
    assert row, f"no ratio row for {workload} / {config} / {reference} in the report"
    return float(row.group(1))


def _config(role: str, ms: float, memory: tuple[int, int, int] | None = None,
            formula: float | None = None, traffic: float | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": role, "ms": ms}
    if memory:
        p, g, o = memory
        entry["memory"] = {"params": p, "grads": g, "optim": o, "total": p + g + o}
    if formula:
        entry["zero_formula_bytes"] = formula
        entry["total_over_formula"] = sum(memory or ()) / formula
    if traffic:
        ops = {"barrier": {"calls": 2}, "reduce_scatter": {"calls": 3}}  # the harness's 2
        entry["traffic"] = {"calls": 5, "payload_bytes": int(traffic), "wire_bytes": traffic,
                            "ring_limit_bytes": 8e6, "wire_over_limit": traffic / 8e6,
                            "ops": ops}
    return entry


def _synthetic() -> dict[str, Any]:
    """Results as the suite writes them: ddp and zero on one workload, a failed benchmark,
    and an anchor that was skipped."""
    mib = 2**20
    ddp = {"configs": {"no-comm bound": _config("bound", 200.0),
                       "torch DDP": _config("anchor", 250.0),
                       "metadist ddp": _config("metadist", 240.0, traffic=8e6)},
           "ratios": [{"config": "metadist ddp", "reference": "torch DDP", "ratio": 0.96},
                      {"config": "metadist ddp", "reference": "no-comm bound", "ratio": 1.2}]}
    zero = {"configs": {
        "no-comm bound": _config("bound", 200.0, (4 * mib, 4 * mib, 8 * mib)),
        "torch FSDP2 fully_shard": _config("anchor", 400.0, (2 * mib, 2 * mib, 4 * mib)),
        "metadist zero3": _config("metadist", 260.0, (2 * mib, 2 * mib, 4 * mib), 8 * mib,
                                  traffic=6e6)},
        "ratios": [{"config": "metadist zero3", "reference": "torch FSDP2 fully_shard",
                    "ratio": 0.65},
                   {"config": "metadist zero3", "reference": "no-comm bound", "ratio": 1.3}]}

    def ok(name: str, data: dict[str, Any], skipped: list[str]) -> dict[str, Any]:
        table = {"key": "t", "title": f"{name} table", "columns": ["configuration", "ms"],
                 "rows": [[k, c["ms"]] for k, c in data["configs"].items()]}
        return {"command": f"python -m benchmarks.{name}", "returncode": 0, "seconds": 1.0,
                "log": f"logs/{name}.log", "status": "ok", "result": {
                    "tables": [table], "notes": [], "skipped": skipped,
                    "environment": {"device": "cpu", "backend": "gloo"},
                    "data": {"workloads": {"mlp": {"params": 10**6, **data}}}}}

    return {"command": "metadist bench --only ddp,zero,meta", "machine": {
                **suite.machine(), "device": "cpu", "backend": "gloo"},
            "peers": {"dir": ".bench", "present": False, "installed": {}},
            "settings": {"quick": True, "world": None, "only": ["ddp", "zero", "meta"]},
            "seconds": 3.0, "benchmarks": {
                "ddp": ok("ddp", ddp, []),
                "zero": ok("zero", zero, ["FairScale OSS + ShardedDDP: not installed"]),
                "meta": {"command": "python -m benchmarks.meta", "returncode": 1,
                         "seconds": 0.5, "log": "logs/meta.log", "status": "failed",
                         "error": "exited with status 1; last lines:\nRuntimeError: boom",
                         "result": {"tables": [{"key": "maml", "title": "MAML", "columns": [
                             "ranks", "configuration", "ms"], "rows": [[2, "Engine", 39.0]]}]}}}}


def test_report_writer_draws_plots_and_tables_from_results(tmp_path: Path) -> None:
    path = report.write_report(_synthetic(), tmp_path)
    text = path.read_text()
    assert _ratio(text, "mlp", "metadist ddp", "torch DDP") == pytest.approx(0.96)
    assert _ratio(text, "mlp", "metadist zero3", "torch FSDP2 fully_shard") == pytest.approx(0.65)
    assert _ratio(text, "mlp", "metadist zero3", "no-comm bound") == pytest.approx(1.3)
    for png in ("step_ratios.png", "memory_per_rank.png", "traffic.png"):
        _valid_png(tmp_path / png)
        assert f"]({png})" in text  # embedded
    assert re.search(rf"^\| mlp \| metadist zero3 \| 3 \| 3 reduce_scatter \| {NUMBER} \| "
                     rf"{NUMBER} \| 0.75 \|$", text, re.M), "traffic row, barriers left out"
    assert "| meta | failed |" in text and "RuntimeError: boom" in text  # said, not hidden
    assert "What it measured before it failed" in text and "| 2 | Engine | 39 |" in text
    assert "FairScale OSS + ShardedDDP: not installed" in text
    assert "anchor rows are skipped" in text
    assert "| torch |" in text and "| CPU count |" in text and "metadist bench --only" in text


def test_a_failing_or_hanging_benchmark_does_not_stop_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    (fakes / "fake_broken.py").write_text("raise SystemExit('boom: deliberately broken')\n")
    (fakes / "fake_hangs.py").write_text("import time\ntime.sleep(120)\n")
    (fakes / "fake_fine.py").write_text(
        "import json, sys\n"
        "path = sys.argv[sys.argv.index('--json') + 1]\n"
        "table = {'key': 't', 'title': 'fine table', 'columns': ['row', 'ratio'],\n"
        "         'rows': [['only', 0.5]]}\n"
        "json.dump({'tables': [table], 'notes': [], 'skipped': [], 'data': {},\n"
        "           'environment': {'device': 'cpu'}}, open(path, 'w'))\n")
    monkeypatch.setenv("PYTHONPATH", str(fakes))
    specs = [suite.Spec("broken", "fake_broken"), suite.Spec("hangs", "fake_hangs"),
             suite.Spec("fine", "fake_fine")]
    out = tmp_path / "out"
    results = suite.run_suite(specs, out, quick=True, timeout=3, echo=None)
    runs = results["benchmarks"]
    assert [runs[n]["status"] for n in ("broken", "hangs", "fine")] == ["failed", "failed", "ok"]
    assert "boom: deliberately broken" in runs["broken"]["error"]
    assert runs["hangs"]["error"].startswith("timed out after 3 s")
    # the load the figures were measured under, and the code they were measured on
    assert all(len(runs[n]["loadavg"]) == 3 for n in runs)
    assert len(results["machine"]["loadavg"]) == 3
    assert results["machine"]["commit"] and isinstance(results["machine"]["dirty"], bool)
    text = (out / "report.md").read_text()
    assert "| only | 0.5 |" in text and "boom: deliberately broken" in text
    assert json.loads((out / "results.json").read_text())["benchmarks"]["fine"]["status"] == "ok"


def test_unknown_benchmark_lists_the_valid_choices(tmp_path: Path,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--only", "ddp,zer0", "--out", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err
    assert ("benchmark 'zer0' is not known; choose from: comm, ddp, zero, precision, "
            "checkpoint, meta, mapreduce") in err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_suite_not_found_says_where_it_looked_and_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_suite_roots", lambda: [tmp_path])
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"benchmark suite (benchmarks/suite.py) was not found in {tmp_path}" in err
    assert "run `metadist bench` from a clone of the metadist repository" in err


@pytest.mark.launcher
def test_metadist_bench_quick_writes_report_results_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    assert cli.main(["bench", "--quick", "--only", "ddp,zero,real_models", "--out",
                     str(out)]) == 0
    text = (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())

    assert {"command", "machine", "peers", "settings", "benchmarks", "seconds"} <= set(results)
    assert results["command"].startswith("metadist bench") and "--quick" in results["command"]
    assert {"torch", "cpu_count", "date", "device"} <= set(results["machine"])
    assert list(results["benchmarks"]) == ["ddp", "zero", "real_models"]
    for name, entry in results["benchmarks"].items():
        assert entry["status"] == "ok", entry.get("error")
        assert entry["result"]["tables"], f"{name} recorded no tables"
    zero3 = results["benchmarks"]["zero"]["result"]["data"]["workloads"]["mlp"]["configs"][
        "metadist zero3"]
    assert set(zero3["memory"]) == {"params", "grads", "optim", "total"}
    assert zero3["total_over_formula"] > 0 and zero3["traffic"]["ring_limit_bytes"] > 0

    for workload in ("mlp", "transformer"):
        assert _ratio(text, workload, "metadist ddp", "torch DDP") > 0
        assert _ratio(text, workload, "metadist ddp", "no-comm bound") > 0
        assert _ratio(text, workload, "metadist zero1",
                      "torch ZeRO (DDP + ZeroRedundancyOptimizer)") > 0
        assert _ratio(text, workload, "metadist zero3", "torch FSDP2 fully_shard") > 0
    assert _ratio(text, "gpt2", "metadist ddp", "torch DDP") > 0  # HuggingFace GPT-2
    assert _ratio(text, "gpt2", "metadist zero3", "torch FSDP2 fully_shard") > 0
    gpt2 = results["benchmarks"]["real_models"]["result"]["data"]["workloads"]["gpt2"]
    assert gpt2["configs"]["metadist zero3"]["total_over_formula"] > 0
    assert re.search(rf"^\| metadist zero3 \| {NUMBER} \| {NUMBER} \| {NUMBER} \| "
                     rf"(?:{NUMBER} \| ){{4}}1\.0\d\d \|$", text, re.M), "zero3 vs formula"
    for png in ("step_ratios.png", "memory_per_rank.png", "traffic.png"):
        _valid_png(out / png)
        assert f"]({png})" in text
    if not results["peers"]["present"]:
        assert "anchor rows are skipped" in text and "FairScale OSS + ShardedDDP" in text


# ----- the README's benchmark sections (benchmarks/readme.py) -----------------------------------
from benchmarks import readme  # noqa: E402


def _full_run() -> dict[str, Any]:
    """The synthetic results as a full (not --quick) run, with the load the suite records;
    comm was left out (--only) and meta failed."""
    results = _synthetic()
    results["settings"]["quick"] = False
    results["machine"].update(loadavg=[1.5, 1.2, 1.0], commit="0123456789ab", dirty=True)
    for i, entry in enumerate(results["benchmarks"].values()):
        entry["loadavg"] = [2.0 + i, 1.5, 1.0]
    return results


def _readme_with_markers(names: list[str]) -> str:
    parts = ["# project", "", "Hand-written text stays.", ""]
    for name in names:
        parts += [f"### {name}", "", "prose before", "", f"<!-- bench: {name} -->",
                  "| stale | table |", "|---|---|", "| 1 | 2 |", f"<!-- /bench: {name} -->", "",
                  "prose after", ""]
    return "\n".join(parts)


def _targets(tmp_path: Path) -> tuple[Path, Path]:
    """A README holding the front sections' markers and a benchmarks page holding the rest."""
    target, page = tmp_path / "README.md", tmp_path / "benchmarks.md"
    target.write_text(_readme_with_markers(list(readme.FRONT)))
    page.write_text(_readme_with_markers([n for n in readme.SECTIONS if n not in readme.FRONT]))
    return target, page


def test_readme_generator_rewrites_its_sections_from_results(tmp_path: Path) -> None:
    results = _full_run()
    source = tmp_path / "bench" / "results.json"
    source.parent.mkdir()
    source.write_text(json.dumps(results))
    (source.parent / "traffic.png").write_bytes(b"\x89PNG plot")
    target, page = _targets(tmp_path)
    figures = tmp_path / "figures"
    argv = [str(source), "--readme", str(target), "--page", str(page), "--figures", str(figures)]

    assert readme.main([*argv, "--check"]) == 1  # stale: it would change
    assert readme.main(argv) == 0
    text = target.read_text() + page.read_text()
    got = readme.current(text)
    assert set(readme.current(target.read_text())) == set(readme.FRONT)  # the README's
    assert got == readme.sections(results)  # every section is exactly the generator's
    assert readme.main([*argv, "--check"]) == 0  # and a second run changes nothing
    assert "| stale |" not in text
    assert text.count("prose before") == text.count("prose after") == len(readme.SECTIONS)
    assert text.startswith("# project\n\nHand-written text stays.\n")
    assert "| mlp | metadist ddp | torch DDP | 240 | 250 | 0.96 |" in got["front"]

    assert ("| mlp | metadist ddp | torch DDP | 240 | 250 | 0.96 |" in got["headline"]
            and "time ratio configuration / reference" in got["headline"])
    assert "| mlp | metadist zero3 | torch FSDP2 fully_shard | <= 0.6 | 0.65 | **no** |" \
           in got["headline"]
    assert "| mlp | metadist ddp | torch DDP | <= 1 | 0.96 | yes |" in got["headline"]
    assert "`python -m benchmarks.ddp` (1-minute load average as it ended: 2.0):" in got["ddp"]
    assert "| metadist ddp | 240 |" in got["ddp"]
    assert "*Skipped in this run: FairScale OSS + ShardedDDP: not installed*" in got["zero"]
    assert "| mlp | metadist zero3 | 3 | 3 reduce_scatter |" in got["zero"]  # barriers left out
    assert got["meta"].startswith("*Not measured in this run: `meta` failed (exited with "
                                  "status 1); see the run's report.*")
    assert got["comm"].startswith("*Not measured in this run: `comm` was not run")
    machine = got["machine"]
    assert ("`metadist bench --only ddp,zero,meta` run of commit 0123456789ab with uncommitted "
            "changes of") in machine
    assert "The 1-minute load average was 1.5 at its start and 2.0-4.0 after each" in machine
    assert (figures / "traffic.png").read_bytes() == b"\x89PNG plot"  # the run's plots
    assert json.loads((figures / readme.RESULTS_COPY).read_text()) == results


def test_readme_generator_merges_a_benchmark_run_of_its_own(tmp_path: Path) -> None:
    """`--merge`: a benchmark re-run on its own (`metadist bench --only NAME`) replaces that
    benchmark's sections and plot, and every figure from it says which run it is."""
    results, part = _full_run(), _full_run()
    part["command"] = "metadist bench --only ddp"
    part["machine"].update(date="2026-12-01T10:00:00+00:00", commit="fedcba987654",
                           dirty=False)
    part["benchmarks"] = {"ddp": part["benchmarks"]["ddp"]}
    part["benchmarks"]["ddp"]["result"]["tables"][0]["rows"][0][1] = 123.0
    main, other = tmp_path / "main" / "results.json", tmp_path / "other" / "results.json"
    for path, data in ((main, results), (other, part)):
        path.parent.mkdir()
        path.write_text(json.dumps(data))
    (main.parent / "traffic.png").write_bytes(b"\x89PNG main")
    (other.parent / "traffic.png").write_bytes(b"\x89PNG other")
    (target, page), figures = _targets(tmp_path), tmp_path / "figures"
    assert readme.main([str(main), "--readme", str(target), "--page", str(page), "--figures",
                        str(figures), "--merge", str(other)]) == 0
    got = readme.current(target.read_text() + page.read_text())
    assert ("measured in a separate run (`metadist bench --only ddp`, 2026-12-01, commit "
            "fedcba987654)") in got["ddp"] and "| 123 |" in got["ddp"]
    assert "separate run" not in got["zero"]  # the main run's
    assert "The sections of ddp come from separate runs, each saying which." in got["machine"]
    assert (figures / "traffic.png").read_bytes() == b"\x89PNG other"
    copy = json.loads((figures / readme.RESULTS_COPY).read_text())
    assert readme.sections(copy) == got  # the committed copy reproduces the README
    part["settings"]["quick"] = True
    with pytest.raises(readme.ReadmeError, match="--quick"):
        readme.merged(results, part)


def test_readme_generator_refuses_what_it_cannot_write_truthfully() -> None:
    results = _full_run()
    with pytest.raises(readme.ReadmeError, match="--quick"):
        readme.sections({**results, "settings": {**results["settings"], "quick": True}})
    with pytest.raises(readme.ReadmeError, match="exactly once"):
        readme.rewrite("no markers here\n", readme.sections(results))
    with pytest.raises(readme.ReadmeError, match="does not make: nope"):
        readme.rewrite("<!-- bench: nope -->\n<!-- /bench: nope -->\n", {"ddp": "x\n"})
    # A column that leaves open what it measures, e.g. TorchOpt's old "x TorchOpt" label
    # read as a time ratio, must get a label first.
    assert readme.label("torchopt_compat", "x TorchOpt").startswith("throughput ratio")
    assert readme.label("comm", "speed-up").startswith("speed-up (time ratio")
    with pytest.raises(readme.ReadmeError, match="does not say what it is"):
        readme.label("ddp", "ours / theirs")


def test_readme_benchmark_sections_are_the_committed_runs() -> None:
    """The README's figures are what benchmarks/readme.py makes of the run committed beside
    its plots (docs/figures/bench-results.json): none is edited by hand."""
    results = json.loads((readme.FIGURES / readme.RESULTS_COPY).read_text())
    text = readme.README.read_text() + readme.PAGE.read_text()
    want = readme.sections(results)
    assert readme.current(text) == want, (
        "the benchmark sections of README.md and docs/benchmarks.md differ from "
        "docs/figures/bench-results.json: rerun `python -m benchmarks.readme "
        "out/bench/results.json` after `make bench`")
    assert set(readme.current(readme.README.read_text())) == set(readme.FRONT)
    for name in readme.PLOTS:
        if f"figures/{name}" in text:
            assert (readme.FIGURES / name).is_file(), name
