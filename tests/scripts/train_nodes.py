"""Train a small model for 12 steps under STRATEGY and write rank 0's final parameters to
OUT (the two-node tests compare a job across two hosts with the same job on one).

    python -m metadist run ... tests/scripts/train_nodes.py STRATEGY OUT
"""

import sys

import torch
from torch import nn

import metadist

name, out = sys.argv[1], sys.argv[2]
strategy = metadist.strategy(name)
world = strategy.world
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
model, optimizer = strategy.setup(model, optimizer)
data = torch.Generator().manual_seed(1)
global_batch = 12  # divisible by 1-4 ranks: every rank reads its own slice of the same batch
for _ in range(12):
    x = torch.randn(global_batch, 8, generator=data)
    y = torch.randn(global_batch, 3, generator=data)
    share = global_batch // world.world_size
    rows = slice(world.rank * share, (world.rank + 1) * share)
    loss = nn.functional.mse_loss(model(x[rows]), y[rows])
    optimizer.zero_grad()
    strategy.backward(loss)
    optimizer.step()
state = {k: v.detach().clone() for k, v in model.state_dict().items()}
if world.rank == 0:
    torch.save(state, out)
metadist.shutdown()
