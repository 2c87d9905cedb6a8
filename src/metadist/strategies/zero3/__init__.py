"""zero3/fsdp and hsdp: parameters sharded in flat units, gathered before each unit's forward
and backward; the fast-weight forward of an inner loop on those shards.

The strategy (``strategy.py``, ``hsdp.py``) plans units (``wrap.py``), lays each unit's
parameters out in flat shards (``flat.py``, ``flat_layout.py`` for the optimizer's view) and
runs them through their states (``units.py``, ``unit_state.py``, ``backward_holds.py``,
``backward_coordinator.py``), skipping what no gradient reached (``unreached.py``) and
refusing runs on other tensors (``foreign_runs.py``). Fast weights kept as shards:
``sharded_fast.py``, their differentiable gather ``shard_gather.py``, gathered ahead of use
``fast_ahead.py``.
"""
