"""Worker entry used by ``metadist run``: run the user's script as ``__main__``.

When the script raises, the first rank to fail prints its traceback (once, as one write)
and every other rank a single line: ranks that fail *because* of it (a peer's connection
closed under a collective) are marked secondary. Each leaves torch elastic's error file, from
which ``metadist run`` names the origin rank (``runtime/failures.py``).
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from metadist.runtime import failures, line_output, watchdog


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m metadist.runtime.entry script.py [args...]")
    script = sys.argv[1]
    if not os.path.isfile(script):
        raise SystemExit(f"metadist run: script {script!r} does not exist")
    ErrorHandler().initialize()  # fault handler: native crashes still print a stack
    line_output.install(os.environ.get("RANK", "?"))  # ranks share one terminal: whole lines
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        _run_as_main(script)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return
        raise
    except KeyboardInterrupt:
        # Ctrl-C (the terminal's, or the launcher passing on its own): one line, not a
        # traceback per rank; where it was is all there is to say.
        where = _innermost_user_frame(sys.exc_info()[2])
        rank = os.environ.get("RANK", "?")
        os.write(2, f"[rank {rank}] interrupted (SIGINT) at {where}\n".encode())
        failures.write_error_file("KeyboardInterrupt: interrupted (SIGINT)", where,
                                  secondary=True, printed=True)
        raise SystemExit(128 + 2) from None
    except Exception as exc:
        # Start the traceback at the user's script, not in this entry (or runpy).
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and (
                tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
            tb = tb.tb_next
        failures.record_script_failure(exc.with_traceback(tb), watchdog.claim_first_failure)
        raise SystemExit(1) from None  # reported: Python must not print the traceback again


def _innermost_user_frame(tb: types.TracebackType | None) -> str:
    """``file:line in function`` of the innermost frame outside this entry and runpy."""
    import torch

    libraries = tuple(os.path.dirname(m.__file__ or "") + os.sep
                      for m in (torch, sys.modules["metadist"]))
    where = "an unknown place"
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename not in (__file__, "<frozen runpy>") and not \
                code.co_filename.startswith(libraries):
            where = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return where


def _run_as_main(script: str) -> None:
    """Run ``script`` as ``python script.py`` would: as ``__main__``, and left installed until
    the process exits (runpy puts the launcher's ``__main__`` back when the script returns,
    so objects pickled by reference to the script's classes and functions, e.g. RPC calls a
    serving rank still receives, or exit hooks, would no longer resolve)."""
    if not script.endswith(".py"):  # a zip application or a directory with __main__.py
        runpy.run_path(script, run_name="__main__")
        return
    with open(script, encoding="utf-8") as source:
        code = compile(source.read(), script, "exec")
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=script, __builtins__=builtins, __spec__=None,
                           __loader__=None, __package__=None)
    sys.modules["__main__"] = module
    exec(code, module.__dict__)  # running the user's script is the point


if __name__ == "__main__":
    main()
