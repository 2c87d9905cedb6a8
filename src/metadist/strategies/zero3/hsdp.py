"""``"hsdp"``: hybrid sharding. Parameters, gradients and optimizer state are sharded within
a node (zero3 over the node-local group) and replicated across nodes: gradients are
reduce-scattered inside the node, then summed across nodes over the cross-node group.

Gathers stay on the fast intra-node links; only shard-sized gradients cross nodes. On one
machine ``metadist.launch(fn, 4, nnodes=2)`` (or two ``metadist run --nnodes 2``) simulates
two nodes of two ranks.
"""

from __future__ import annotations

import metadist.runtime.world as _world
from metadist.runtime.world import Group
from metadist.strategies.registry import register
from metadist.strategies.zero3.strategy import Zero3Strategy


@register("hsdp")
class HSDPStrategy(Zero3Strategy):
    """Shard within a node, replicate across nodes (the runtime's 2-D groups)."""

    def groups(self) -> tuple[Group, Group]:
        return _world.node_group(), _world.cross_node_group()
