"""Every rank prints argv[1] short lines at once (flushing each): the lines must arrive whole."""

import sys

import metadist

count = int(sys.argv[1])
w = metadist.init()
for i in range(count):
    print(f"rank {w.rank} line {i} " + "x" * 40, flush=True)
metadist.shutdown()
