"""A pre-loaded interpreter that runs the docs' ```python blocks, each in a forked child.

Importing torch and metadist costs seconds per process; the docs have dozens of Python
blocks. This server imports them once, then reads one JSON request per line on stdin
(``{"code", "cwd", "env", "timeout", "name"}``), forks a child per request and answers one
JSON line on stdout (``{"rc", "output", "timed_out"}``).

The child runs the code the way ``python script.py`` would, except that ``__main__`` has no
``__file__`` (as in a notebook): in its own session (so the whole process tree can be
killed), in ``cwd`` (also ``sys.path[0]``), with ``env`` as its environment, stdout and
stderr going to one file. ``metadist.launch`` then forks its ranks from the already
loaded interpreter instead of spawning fresh ones, as it does in a notebook.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
import types

# Pre-loaded for the children: torch, metadist, and what they import lazily.
import torch
import torch.distributed.rpc
import torch.func
import torch.utils.checkpoint

import metadist.mapreduce
import metadist.meta  # noqa: F401

# The first optimizer of a process imports torch._dynamo (over a second); pay it once here.
torch.optim.Adam([torch.zeros(1, requires_grad=True)])

_POLL_S = 0.02


def _child(code: str, cwd: str, env: dict[str, str], name: str, out_fd: int) -> None:
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the requests' pipe is not the block's business
    os.close(devnull)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    status = 0
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[0] = cwd
        sys.argv = [name]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(code, name, "exec"), main.__dict__)
    except SystemExit as exc:
        code_ = exc.code
        if code_ is None:
            status = 0
        elif isinstance(code_, int):
            status = code_
        else:
            print(code_, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _serve(request: dict[str, object]) -> dict[str, object]:
    code, cwd, name = str(request["code"]), str(request["cwd"]), str(request["name"])
    env = {str(k): str(v) for k, v in dict(request["env"]).items()}  # type: ignore[call-overload]
    timeout = float(request["timeout"])  # type: ignore[arg-type]
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(code, cwd, env, name, out.fileno())
        deadline = time.monotonic() + timeout
        timed_out = False
        status = 0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                _kill_tree(pid)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(_POLL_S)
        _kill_tree(pid)  # ranks or helpers the block left behind
        out.seek(0)
        output = out.read().decode("utf-8", "replace")
    rc = os.waitstatus_to_exitcode(status)
    return {"rc": rc, "output": output, "timed_out": timed_out}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of the server itself must not corrupt the replies
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = _serve(json.loads(line))
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
