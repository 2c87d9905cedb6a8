"""Under `metadist run`: print the local addresses this worker and its launcher agent listen
on, after the process group formed, as ``rank=R who=worker|agent address``."""

import os

import metadist
from metadist.testing import listening_addresses

w = metadist.init()
metadist.barrier()
rows = "".join(f"rank={w.rank} who={who} {address}\n"
               for who, pid in (("worker", os.getpid()), ("agent", os.getppid()))
               for address in listening_addresses(pid))
os.write(1, rows.encode())  # one write (under PIPE_BUF): two ranks' lines never interleave
metadist.barrier()
