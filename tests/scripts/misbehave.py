"""Two all-reduces; between them rank $VICTIM (default 1) misbehaves as argv[1] says:
raise, exit (os._exit(3)), kill (SIGKILL), hang (sleep far past the timeout), skip (end the
program cleanly without the second one), or none."""

import os
import signal
import sys
import time

import torch

import metadist
from metadist import comm

mode = sys.argv[1] if len(sys.argv) > 1 else "none"
w = metadist.init()
t = torch.ones(4)
comm.all_reduce(t)  # #1 on every rank
if w.rank == int(os.environ.get("VICTIM", "1")):
    match mode:
        case "raise":
            raise ValueError(f"deliberate failure on rank {w.rank}")
        case "exit":
            os._exit(3)
        case "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        case "hang":
            time.sleep(600)
        case "skip":
            sys.exit(0)
comm.all_reduce(t)  # #2: the others wait here for the victim
os.write(1, f"rank={w.rank} done\n".encode())
metadist.shutdown()
