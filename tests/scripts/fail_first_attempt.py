"""Fails on rank 1 in the first attempt only, to exercise --max-restarts and tracebacks."""

import os

import metadist

w = metadist.init()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if w.rank == 1 and (attempt == 0 or os.environ.get("ALWAYS_FAIL")):
    raise ValueError(f"deliberate failure on rank 1, attempt {attempt}")
metadist.barrier()
os.write(1, f"rank={w.rank} survived attempt={attempt}\n".encode())
metadist.shutdown()
