"""Training that checkpoints every 3 steps, run by ``metadist run --nproc 2 --max-restarts 1``.

On the first attempt rank 1 SIGKILLs itself: ``--kill between`` right after step 7 (the last
complete checkpoint is step 6's), ``--kill mid-save`` inside step 9's save, after writing its
shard and before the commit (that save never completes: the job must fall back to step 6's).
The restarted job resumes from the last complete checkpoint and finishes; rank 0 then writes
the final parameters, and those of an uninterrupted run of the same training in the same
processes, to ``--out`` for the test to compare bit for bit.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import metadist
from metadist.checkpoint import IncompleteCheckpointError
from metadist.checkpoint import sharded as sharded_format

TOTAL, EVERY, KILL_AFTER, KILL_IN_SAVE = 14, 3, 7, 9


def say(text: str) -> None:
    os.write(1, f"{text}\n".encode())  # one write per line: ranks' lines never interleave


def die_inside_the_next_shard_write() -> None:
    write = sharded_format.write_rank_file

    def write_then_die(path: Path, slices: Any) -> Any:
        write(path, slices)
        os.kill(os.getpid(), signal.SIGKILL)

    sharded_format.write_rank_file = write_then_die


def train(strategy: str, ckpt: Path | None, kill: str, attempt: int) -> dict[str, torch.Tensor]:
    rank = metadist.world().rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 2))
    torch.manual_seed(1234 + rank)  # dropout masks differ per rank: checkpoints restore them
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 2, generator=g))
    s = metadist.strategy(strategy, **({"min_unit_params": 30} if strategy == "zero3" else {}))
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = s.setup_dataloader(DataLoader(data, batch_size=4, shuffle=True))  # 5 steps/epoch
    state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched,
                             "loader": loader, "step": 0}
    if ckpt is not None and ckpt.exists():
        stray = sum(1 for p in ckpt.iterdir() if p.name.startswith("v-")) - 1
        try:
            s.load(ckpt, state)
            say(f"rank={rank} attempt={attempt} resumed step={state['step']} stray={stray}")
        except IncompleteCheckpointError:
            pass  # the first save never completed: start from scratch
    step = state["step"]
    while step < TOTAL:
        for x, y in loader:
            opt.zero_grad()
            s.backward(((model(x) - y) ** 2).mean())
            opt.step()
            sched.step()
            step += 1
            doomed = kill != "none" and attempt == 0 and rank == 1
            if ckpt is not None and step % EVERY == 0:
                state["step"] = step
                if doomed and kill == "mid-save" and step == KILL_IN_SAVE:
                    die_inside_the_next_shard_write()
                s.save(ckpt, state)
            if doomed and kill == "between" and step == KILL_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == TOTAL:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill", choices=["none", "between", "mid-save"], default="none")
    ap.add_argument("--strategy", default="ddp")
    args = ap.parse_args()
    metadist.init()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    resumed = train(args.strategy, out / "ckpt", args.kill, attempt)
    reference = train(args.strategy, None, "none", attempt)  # uninterrupted, same processes
    if metadist.world().rank == 0:
        torch.save({"resumed": resumed, "reference": reference}, out / "final.pt")
    metadist.barrier()
    say(f"rank={metadist.world().rank} attempt={attempt} finished")
    metadist.shutdown()


if __name__ == "__main__":
    main()
