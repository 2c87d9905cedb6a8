"""FairScale's API on metadist: ``from fairscale.optim.oss import OSS`` becomes
``from metadist.compat.fairscale.optim.oss import OSS`` (and so on for ``nn.data_parallel``,
``nn.checkpoint``, ``nn.wrap`` and ``optim.grad_scaler``), and nothing else changes.

A thin layer over metadist's strategies: OSS with ShardedDataParallel is "zero2",
FullyShardedDataParallel is "zero3" with each nested instance a unit, on the process group
the program created itself (metadist adopts it). The numbers are one process's on the global
batch, as FairScale's are. An option metadist cannot honour stops with an error naming it.
docs/coming-from-fairscale.md lists the mapping.
"""

from metadist.compat.fairscale import nn, optim

__all__ = ["nn", "optim"]
