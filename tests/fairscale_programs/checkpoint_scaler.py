"""The FairScale seed's second program: a model whose feed-forward block is wrapped by
``checkpoint_wrapper`` (``offload_to_cpu`` as the argument says), trained with
``ShardedGradScaler`` under autocast, here on OSS + ShardedDDP over ranks the program
spawns itself. Dropout is 0 (the seed's 0.5 draws each rank's masks apart from one
process's). Only the FairScale imports depend on ``LIBRARY``.

    python checkpoint_scaler.py WORLD_SIZE PORT OUT [--offload]
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn, optim
from torch.amp import autocast

if os.environ.get("LIBRARY") == "fairscale":
    from fairscale.nn.checkpoint.checkpoint_activations import checkpoint_wrapper
    from fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP
    from fairscale.optim.grad_scaler import ShardedGradScaler
    from fairscale.optim.oss import OSS
else:
    from metadist.compat.fairscale.nn.checkpoint.checkpoint_activations import (
        checkpoint_wrapper,
    )
    from metadist.compat.fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP
    from metadist.compat.fairscale.optim.grad_scaler import ShardedGradScaler
    from metadist.compat.fairscale.optim.oss import OSS

STEPS, GLOBAL_BATCH = 10, 12


class CheckpointModel(nn.Module):

    def __init__(self, **kwargs):
        super().__init__()
        torch.manual_seed(0)  # make sure weights are deterministic.
        self.ffn_module = nn.Sequential(
            nn.Linear(32, 128),
            nn.Dropout(p=0.0),
            nn.Linear(128, 32),
        )

        self.ffn_module = checkpoint_wrapper(self.ffn_module, **kwargs)
        self.last_linear = nn.Linear(32, 1)

    def forward(self, input):
        output = self.ffn_module(input)
        return self.last_linear(output)


def train(rank, world_size, port, out, offload):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)

    # Creates model and optimizer in default precision
    model = CheckpointModel(offload_to_cpu=offload)
    optimizer = OSS(model.parameters(), optim=optim.SGD, lr=0.05, momentum=0.9)
    model = ShardedDDP(model, optimizer)
    loss_fn = nn.MSELoss()

    # Creates a ShardedGradScaler once at the beginning of training.
    scaler = ShardedGradScaler()

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL_BATCH, 32, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g))
            for _ in range(STEPS)]
    share = GLOBAL_BATCH // world_size
    for input, target in data:
        mine = slice(rank * share, (rank + 1) * share)
        input, target = input[mine], target[mine]
        optimizer.zero_grad()
        with autocast("cuda", enabled=torch.cuda.is_available()):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.consolidate_state_dict()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "norms": []}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(train, args=(world_size, port, out, "--offload" in sys.argv), nprocs=world_size,
             join=True)
