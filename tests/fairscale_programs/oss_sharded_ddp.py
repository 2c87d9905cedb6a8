"""The FairScale seed's first program: OSS + ShardedDDP started with mp.spawn on a process
group the program initialises itself. Only the two FairScale imports depend on ``LIBRARY``
(the environment variable tests set): FairScale 0.4.13 itself, or metadist's drop-in.

    python oss_sharded_ddp.py WORLD_SIZE PORT OUT [--freeze]
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

if os.environ.get("LIBRARY") == "fairscale":
    from fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP
    from fairscale.optim.oss import OSS
else:
    from metadist.compat.fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP
    from metadist.compat.fairscale.optim.oss import OSS

EPOCHS, STEPS, GLOBAL_BATCH = 3, 4, 12


def dist_init(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(),
                         nn.Linear(32, 1))


def dataloader(rank, world_size):
    """Every rank's share of the same global batches, in order."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL_BATCH, 32, generator=g)
    y = torch.randn(STEPS * GLOBAL_BATCH, 1, generator=g)
    share = GLOBAL_BATCH // world_size
    return [(x[i * GLOBAL_BATCH:][rank * share:(rank + 1) * share],
             y[i * GLOBAL_BATCH:][rank * share:(rank + 1) * share]) for i in range(STEPS)]


def train(rank, world_size, port, out, freeze):
    # process group init
    dist_init(rank, world_size, port)

    # Problem statement
    net = model()
    data = dataloader(rank, world_size)
    loss_fn = nn.MSELoss()

    # optimizer specific arguments e.g. LR, momentum, etc...
    base_optimizer_arguments = {"lr": 1e-2, "momentum": 0.9}

    # Wrap a base optimizer into OSS
    base_optimizer = torch.optim.SGD  # any pytorch compliant optimizer
    optimizer = OSS(params=net.parameters(), optim=base_optimizer, **base_optimizer_arguments)

    # Wrap the model into ShardedDDP, which will reduce gradients to the proper ranks
    model_ = ShardedDDP(net, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)

    # Any relevant training loop, nothing specific to OSS. For example:
    model_.train()
    norms = []
    for e in range(EPOCHS):
        if freeze and e == 1:  # freeze the first layer after the first epoch
            net[0].weight.requires_grad_(False)
            model_.refresh_trainable()
        for data_, target in data:
            model_.zero_grad()
            outputs = model_(data_)
            loss = loss_fn(outputs, target)
            loss.backward()
            norms.append(float(optimizer.clip_grad_norm(5.0)))
            optimizer.step()
            scheduler.step()
    optimizer.consolidate_state_dict()
    if rank == 0:
        torch.save({"model": model_.module.state_dict(), "keys": list(model_.state_dict()),
                    "optimizer": optimizer.state_dict(), "norms": norms}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(train, args=(world_size, port, out, "--freeze" in sys.argv), nprocs=world_size,
             join=True)
