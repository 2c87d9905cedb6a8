"""Under `metadist run`: print the local addresses this worker and its launcher agent listen
on, after the process group formed (Linux /proc), as ``rank=R who=worker|agent hex-address``."""

import os

import metadist


def listening(pid: int) -> list[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                    found.append(cols[1].split(":")[0])
    return found


w = metadist.init()
metadist.barrier()
for who, pid in (("worker", os.getpid()), ("agent", os.getppid())):
    for address in listening(pid):
        print(f"rank={w.rank} who={who} {address}", flush=True)
metadist.barrier()
