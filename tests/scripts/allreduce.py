"""All-reduce rank + 1 and print the result with the detected world (launcher tests)."""

import os

import torch

import metadist
from metadist import comm

w = metadist.init()
t = torch.tensor([float(w.rank + 1)])
comm.all_reduce(t)
line = (f"rank={w.rank} world={w.world_size} node={w.node_rank}/{w.num_nodes} "
        f"local={w.local_rank}/{w.local_world_size} launcher={w.launcher} result={int(t.item())}")
os.write(1, (line + "\n").encode())  # one write: lines of two ranks never interleave
metadist.shutdown()
