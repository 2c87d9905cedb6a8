"""What every part of the FairScale drop-in checks: the process group, and options it cannot
honour."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import metadist


def check_group(group: Any, where: str) -> None:
    """metadist's strategies run on the world the program joined: another group cannot be
    honoured without sharding over a different set of ranks than the gradients are averaged on."""
    world = metadist.init()  # adopts the group the program initialised itself
    if group is None or group is dist.group.WORLD:
        return
    size = dist.get_world_size(group)
    if size == world.world_size:
        return  # every rank: the world under another handle
    raise ValueError(
        f"{where}: a process group of {size} of the {world.world_size} ranks cannot be "
        "honoured: metadist shards and averages over every rank of the job. Drop the group "
        'argument (or pass group=None), or use metadist.strategy("hsdp") to shard within '
        "nodes and replicate across them")


def refuse(where: str, option: str, value: Any, instead: str) -> None:
    """Stop on a FairScale option whose effect metadist does not provide."""
    raise ValueError(f"{where}: {option}={value!r} is not supported by metadist's FairScale "
                     f"drop-in; {instead}")
