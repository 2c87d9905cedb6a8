"""Tour of the collectives across the ranks of a job (run with ``metadist demo collectives``)."""

from __future__ import annotations

import torch

import metadist
from metadist import comm
from metadist.comm import functional


def main() -> None:
    w = metadist.init()
    r, n = w.rank, w.world_size
    metadist.print(f"{n} ranks, launcher {w.launcher}, backend {w.backend}, device {w.device}")

    t = torch.tensor([float(r + 1)])
    comm.all_reduce(t)
    metadist.print(f"all_reduce(rank + 1)        = {t.item():g}")

    gathered = torch.empty(n)
    comm.all_gather(gathered, torch.tensor([float(r)]))
    metadist.print(f"all_gather(rank)            = {gathered.tolist()}")

    small = [torch.full((1024,), float(r)) for _ in range(256)]
    with comm.stats.counting() as counted:
        comm.fused_all_reduce(small, "mean")
    metadist.print(f"fused mean of 256 tensors   = {small[0][0].item():g} in {counted.calls} "
                   "collective(s)")

    x = torch.tensor([float(r + 1)], requires_grad=True)
    y = functional.all_reduce(x * x)  # sum_r x_r^2, on every rank
    (g,) = torch.autograd.grad(y.sum() * (r + 1), x)
    # d/dx_r sum_s (s+1) * sum_q x_q^2 = 2 x_r * sum_s (s+1)
    metadist.print(f"differentiable all_reduce: grad on rank 0 = {g.item():g} "
                   f"(expected {2 * 1 * sum(s + 1 for s in range(n)):g})")
    metadist.shutdown()


if __name__ == "__main__":
    main()
