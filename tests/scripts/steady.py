"""All-reduces until the job is stopped, marking (argv[1].<rank>) once it is under way: for
faults injected from outside (a stopped process, a cut network link)."""

import sys
import time

import torch

import metadist
from metadist import comm

marker = sys.argv[1]
w = metadist.init()
x = torch.ones(4)
for i in range(1_000_000):
    comm.all_reduce(x)
    if i == 20:
        open(f"{marker}.{w.rank}", "w").close()  # an empty file is the mark
    time.sleep(0.02)
