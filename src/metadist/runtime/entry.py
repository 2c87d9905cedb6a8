"""Worker entry used by ``metadist run``: run the user's script as ``__main__`` and, when it
raises, record the traceback where torch's elastic agent will show it."""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m metadist.runtime.entry script.py [args...]")
    script = sys.argv[1]
    if not os.path.isfile(script):
        raise SystemExit(f"metadist run: script {script!r} does not exist")
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
