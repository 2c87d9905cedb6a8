"""Every code block of the user documentation (``docs/**/*.md``) runs, one test per page.

Conventions (kept small on purpose):

* A fence's language decides what happens to its block:

  - ```python: run as a script. Blocks of a page run in order in one fresh temporary
    directory per page, so later blocks see the files earlier ones wrote.
  - ```bash: run with ``bash -euo pipefail`` in that directory, with ``.venv/bin`` first on
    PATH (``python``, ``metadist``, ``torchrun`` are the venv's) and ``tests/docs_support/bin``
    next, which holds stand-ins for SLURM's ``srun`` and ``sbatch``: they start the tasks on
    this machine with the variables real srun sets for each task (SLURM_PROCID, SLURM_LOCALID,
    SLURM_NODEID, SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOB_ID, SLURM_TASKS_PER_NODE, ...),
    so the pages' srun and sbatch lines run for real on one node. ``mpirun`` is Debian's
    OpenMPI (``scripts/setup.sh``); the tests run as root, so OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)
    are set.
  - ```text: output or diagrams, never executed.
  - anything else, including a bare fence, fails the test: nothing slips through unrun.

* An HTML comment right before a fence (blank lines between are fine) changes that:

  - ``<!-- docs: file=NAME -->``: write the block (any language) to NAME instead of running
    it; a ```bash block or one starting with ``#!`` is made executable. A later block of the
    page must mention NAME (or, for ``x.py``, import ``x``), else the test fails.
  - ``<!-- docs: continue -->``: append this python block to the previous python block (only
    ```text blocks may come between) and run them as one script, at the first part's place:
    for prose between the parts of one program. Output blocks of either part are checked
    against the output of the whole script.
  - ``<!-- docs: output -->`` (```text only): every non-blank line must appear in the output
    of the block just run; ``...`` inside a line stands for anything (ports, timings), and
    a line that is only ``...`` is skipped. Lines may appear in any order (ranks interleave).
  - ``<!-- docs: exit=N -->``: the block must exit with status N (default 0).
  - ``<!-- docs: timeout=S -->``: seconds the block may run (default 120).

* Python blocks run in a child forked from a server that imported torch and metadist once
  (``tests/docs_support/zygote.py``), as ``__main__`` without ``__file__``, as in a notebook;
  ``metadist.launch`` then forks its ranks instead of spawning fresh interpreters. Bash blocks
  are real processes. The environment holds no launcher variables (RANK, SLURM_*, OMPI_*,
  MASTER_*, METADIST_*, ...), and OMP_NUM_THREADS=1.

* A failure names the page and the line of the block's opening fence, and shows the block and
  the tail of its output. ``test_index_links_every_page`` and
  ``test_relative_links_point_to_existing_files_and_headings`` check the links;
  ``test_the_conventions_reject_what_would_not_run`` checks the parser's refusals.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SUPPORT = Path(__file__).resolve().parent / "docs_support"
PAGES = sorted(DOCS.rglob("*.md"))
LANGUAGES = ("python", "bash", "text")
DIRECTIVES = ("file", "continue", "output", "exit", "timeout")
DEFAULT_TIMEOUT_S = 120.0
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_",
                  "MASTER_", "OMPI_", "PMI", "PMIX", "SLURM", "TORCHELASTIC_", "METADIST_",
                  "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class DocsFormatError(ValueError):
    """A page breaks the conventions above."""


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_absolute() else self.page}:" \
               f"{self.line}"


_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs:(?P<body>.*?)-->\s*$")


def parse(text: str, page: Path) -> list[Block]:
    """The page's fenced blocks with their directives; raises DocsFormatError on misuse."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: dict[str, str] = {}
    pending_line = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line)
        if directive:
            pending = {**pending, **_options(directive.group("body"), page, i + 1)}
            pending_line = i + 1
            i += 1
            continue
        opening = _FENCE.match(line)
        if opening is None:
            if line.strip() and pending:
                raise DocsFormatError(f"{page}:{pending_line}: a docs directive must come right "
                                      "before a fenced block")
            i += 1
            continue
        indent, fence = len(opening.group("indent")), opening.group("fence")
        info = opening.group("info").strip()
        lang = info.split()[0] if info else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (closing and closing.group("fence")[0] == fence[0]
                    and len(closing.group("fence")) >= len(fence)
                    and not closing.group("info").strip()):
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        else:
            raise DocsFormatError(f"{page}:{i + 1}: this fence is never closed")
        if lang not in LANGUAGES:
            raise DocsFormatError(
                f"{page}:{i + 1}: fence language {lang or '(none)'!r} is not one of "
                f"{', '.join(LANGUAGES)}; a block the docs test cannot run must not be there")
        blocks.append(Block(page, i + 1, lang, "\n".join(body) + "\n", pending))
        _check_options(blocks[-1])
        pending = {}
        i = j + 1
    if pending:
        raise DocsFormatError(f"{page}:{pending_line}: a docs directive with no block after it")
    _check_files_used(blocks)
    return blocks


def _options(body: str, page: Path, line: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in body.split():
        key, _, value = item.partition("=")
        if key not in DIRECTIVES:
            raise DocsFormatError(f"{page}:{line}: unknown docs directive {key!r}; known: "
                                  f"{', '.join(DIRECTIVES)}")
        out[key] = value
    return out


def _check_options(block: Block) -> None:
    opts = block.options
    if "output" in opts and block.lang != "text":
        raise DocsFormatError(f"{block.where}: 'output' marks a ```text block")
    if "continue" in opts and (block.lang != "python" or "file" in opts):
        raise DocsFormatError(f"{block.where}: 'continue' appends a ```python block to the "
                              "previous one")
    if "file" in opts and not opts["file"]:
        raise DocsFormatError(f"{block.where}: 'file=' needs a file name")
    if block.lang == "text" and set(opts) - {"output", "file"}:
        raise DocsFormatError(f"{block.where}: a ```text block takes only 'output' or 'file'")
    for key in ("exit", "timeout"):
        if key in opts and not re.fullmatch(r"\d+(\.\d+)?", opts[key]):
            raise DocsFormatError(f"{block.where}: {key}= needs a number")


def _check_files_used(blocks: list[Block]) -> None:
    for k, block in enumerate(blocks):
        name = block.options.get("file")
        if not name:
            continue
        stem = Path(name).stem
        later = [b.code for b in blocks[k + 1:] if b.lang != "text" or "file" in b.options]
        used = any(name in code or (name.endswith(".py") and re.search(
            rf"^\s*(from|import)\s+{re.escape(stem)}\b", code, re.M)) for code in later)
        if not used:
            raise DocsFormatError(f"{block.where}: the file {name} this block writes is never "
                                  "used by a later block of the page")


# ----- running ----------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(SUPPORT / "bin"),
                                   env.get("PATH", "")])
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    env.pop("PYTHONPATH", None)
    return env


class Zygote:
    """The pre-loaded interpreter that runs python blocks (tests/docs_support/zygote.py)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(SUPPORT / "zygote.py")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=_env(), cwd=str(SUPPORT))
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready.strip():
            raise RuntimeError("the docs zygote did not start (see stderr above)")
        return proc

    def run(self, code: str, cwd: Path, name: str, timeout: float) -> tuple[int, str, bool]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        stdin: IO[str] | None = self.proc.stdin
        stdout: IO[str] | None = self.proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps({"code": code, "cwd": str(cwd), "env": _env(), "name": name,
                                "timeout": timeout}) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:  # the server itself died: report it, start a fresh one next time
            self.proc = None
            return -1, "the docs zygote exited while running this block", False
        reply = json.loads(line)
        return int(reply["rc"]), str(reply["output"]), bool(reply["timed_out"])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _run_bash(code: str, cwd: Path, timeout: float) -> tuple[int, str, bool]:
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return -9, out, True
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, 9)  # anything the block left running in the background


def _matches(expected: str, output: str) -> list[str]:
    """Lines of ``expected`` not found in ``output`` (``...`` matches anything)."""
    lines = [" ".join(line.split()) for line in output.splitlines()]
    missing = []
    for raw in expected.splitlines():
        want = " ".join(raw.split())
        if not want or want == "...":
            continue
        pattern = ".*?".join(re.escape(part.strip()) for part in want.split("..."))
        if not any(re.search(pattern, line) for line in lines):
            missing.append(want)
    return missing


def _report(block: Block, rc: int, output: str, why: str) -> str:
    tail = output[-8000:]
    return (f"{block.where}: {block.lang} block {why} (exit status {rc})\n"
            f"--- block ---\n{block.code}--- output (last 8000 characters) ---\n{tail}")


def run_page(page: Path, workdir: Path, zygote: Zygote) -> None:
    blocks = parse(page.read_text(), page)
    last_output: str | None = None
    last_block: Block | None = None
    units: list[list[Block]] = []
    for block in blocks:  # group continuations with the python block they extend
        if "continue" in block.options:
            k = len(units) - 1
            while k >= 0 and units[k][0].lang == "text" and "file" not in units[k][0].options:
                k -= 1  # output blocks may sit between the parts
            if k < 0 or units[k][0].lang != "python" or "file" in units[k][0].options:
                raise DocsFormatError(f"{block.where}: 'continue' needs a python block before "
                                      "it (only ```text blocks may come between)")
            units[k].append(block)
        else:
            units.append([block])
    for unit in units:
        head = unit[0]
        opts = {k: v for b in unit for k, v in b.options.items()}
        if "file" in opts:
            target = workdir / opts["file"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(head.code)
            if head.lang == "bash" or head.code.startswith("#!"):
                target.chmod(0o755)
            continue
        if head.lang == "text":
            if "output" in opts:
                assert last_block is not None and last_output is not None, \
                    f"{head.where}: an output block needs a code block run before it"
                missing = _matches(head.code, last_output)
                assert not missing, _report(
                    last_block, 0, last_output,
                    f"printed output that does not match the page's output block at line "
                    f"{head.line}: missing lines {missing}")
            continue
        code = "".join(b.code for b in unit)
        timeout = float(opts.get("timeout", DEFAULT_TIMEOUT_S))
        if head.lang == "python":
            name = f"{page.relative_to(ROOT)}:{head.line}"
            rc, output, timed_out = zygote.run(code, workdir, name, timeout)
        else:
            rc, output, timed_out = _run_bash(code, workdir, timeout)
        expected = int(opts.get("exit", "0"))
        if timed_out:
            pytest.fail(_report(head, rc, output, f"ran longer than {timeout:g} s"))
        if rc != expected:
            pytest.fail(_report(head, rc, output, f"should exit with status {expected}"))
        last_output, last_block = output, Block(head.page, head.line, head.lang, code, opts)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


@pytest.mark.launcher
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_runs(page: Path, tmp_path: Path, zygote: Zygote) -> None:
    run_page(page, tmp_path, zygote)


# ----- structure ------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out: set[str] = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"^(```|~~~).*?^(```|~~~)\s*$", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return _LINK.findall(text) + _IMAGE.findall(text)


def test_index_links_every_page() -> None:
    index = DOCS / "index.md"
    assert index.is_file(), "docs/index.md is missing"
    linked = {(DOCS / link.split("#")[0]).resolve() for link in _links(index)
              if not re.match(r"[a-z]+:", link)}
    missing = [str(p.relative_to(DOCS)) for p in PAGES if p != index and p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def test_relative_links_point_to_existing_files_and_headings() -> None:
    broken = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(DOCS)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(DOCS)}: {link} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_conventions_reject_what_would_not_run() -> None:
    page = Path("example.md")
    for text, message in [
        ("```js\nx\n```\n", "not one of"),
        ("```\nx\n```\n", "not one of"),
        ("```python\nx\n", "never closed"),
        ("<!-- docs: file=a.py -->\n```python\nx = 1\n```\n", "never used"),
        ("```python\nx = 1\n```\n<!-- docs: output -->\n```bash\nx\n```\n", "marks a ```text"),
        ("<!-- docs: nope -->\n```python\nx = 1\n```\n", "unknown docs directive"),
        ("<!-- docs: exit=1 -->\ntext\n```python\nx = 1\n```\n", "right before"),
    ]:
        with pytest.raises(DocsFormatError, match=re.escape(message)):
            parse(text, page)
    blocks = parse("<!-- docs: file=m.py -->\n```python\nA = 1\n```\n\n```python\nimport m\n"
                   "```\n<!-- docs: output -->\n```text\nrank 0 ... done\n```\n", page)
    assert [b.lang for b in blocks] == ["python", "python", "text"]
    assert _matches("rank 0 ... done\n...\n", "x\nrank 0 took 3 s, done\n") == []
    assert _matches("rank 1 ... done\n", "rank 0 took 3 s, done\n") == ["rank 1 ... done"]


def test_support_scripts_are_executable() -> None:
    for name in ("srun", "sbatch"):
        path = SUPPORT / "bin" / name
        assert os.access(path, os.X_OK), f"{path} must be executable"
    assert shutil.which("bash"), "the docs test needs bash"
