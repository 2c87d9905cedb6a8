"""A FairScale FullyShardedDataParallel program: blocks wrapped by ``enable_wrap``/``wrap``
and ``auto_wrap``, the root wrapped by hand, the optimizer built on the wrapped model's
parameters, FSDP's own ``clip_grad_norm_``, a full state dict and the optimizer's whole
state at the end. Only the FairScale imports differ from a FairScale program (FairScale's
own FSDP needs CUDA; this runs on the CPU too).

    python fsdp_nested.py WORLD_SIZE PORT OUT [--reshard-off]
"""

import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from metadist.compat.fairscale.nn import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap
from metadist.compat.fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

STEPS, GLOBAL_BATCH = 10, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, reshard):
        super().__init__()
        torch.manual_seed(0)
        with enable_wrap(wrapper_cls=FSDP, reshard_after_forward=reshard):
            self.embed = wrap(nn.Linear(8, 16))
            self.blocks = auto_wrap(nn.Sequential(Block(), Block(), Block()),
                                    auto_wrap_policy=functools.partial(
                                        default_auto_wrap_policy, min_num_params=1000))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def train(rank, world_size, port, out, reshard):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    model = FSDP(Net(reshard), reshard_after_forward=reshard)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(STEPS * GLOBAL_BATCH, 1, generator=g)
    share = GLOBAL_BATCH // world_size
    norms = []
    for i in range(STEPS):
        batch = slice(i * GLOBAL_BATCH + rank * share, i * GLOBAL_BATCH + (rank + 1) * share)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        loss.backward()
        norms.append(float(model.clip_grad_norm_(1.0)))
        optimizer.step()
    state = model.state_dict()
    optim_state = model.gather_full_optim_state_dict(optimizer)
    if rank == 0:
        torch.save({"model": state, "optimizer": optim_state, "norms": norms,
                    "names": [n for n, _ in model.named_parameters()]}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(train, args=(world_size, port, out, "--reshard-off" not in sys.argv),
             nprocs=world_size, join=True)
