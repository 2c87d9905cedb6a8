"""What rank-local tensors do where one process's would compute a global value: zero3/hsdp
shards and what is computed from them (``shard_value.py``), sharded fast-weight pieces
(``shard_piece.py``), zero2's placeholders for gradients other ranks own
(``elsewhere.py``), and torch's gradient utilities made global over them
(``grad_norm.py``).
"""
