"""All-reduce like allreduce.py, then wait until the world has $TARGET ranks: torch's elastic
agent restarts the workers when another node joins (launcher tests)."""

import os
import time

import torch

import metadist
from metadist import comm

w = metadist.init()
t = torch.tensor([float(w.rank + 1)])
comm.all_reduce(t)
line = (f"rank={w.rank} world={w.world_size} node={w.node_rank}/{w.num_nodes} "
        f"local={w.local_rank}/{w.local_world_size} launcher={w.launcher} result={int(t.item())}")
os.write(1, (line + "\n").encode())
metadist.shutdown()
if w.world_size < int(os.environ.get("TARGET", "2")):
    time.sleep(120)  # stopped and restarted in a larger world long before this ends
