"""What rank-local tensors do where one process's would compute a global value: zero3/hsdp
shards and what is computed from them (``shard_value.py``), sharded fast-weight pieces
(``shard_piece.py``), zero2's placeholders for gradients other ranks own
(``elsewhere.py``), whole reductions over them (``whole_reductions.py``), torch's gradient
utilities made global over them (``grad_norm.py``), and the one policy of which calls run,
compute globally or stop, by which every kind decides (``policy.py``).
"""
