"""Tensor parallelism within one engine (``EngineConfig.tensor_parallel_size``).

The model's heads, kv heads, MLP and LM-head vocabulary are split over N
ranks (sharding.py), one process and one device each. Rank 0 is the engine:
its scheduler, block pool and sampler are the only ones; each pass is
broadcast to the other ranks (steps.py), which run their share over their
own KV cache, where the same block ids hold their kv heads. KV blocks leave
and enter the engine whole, gathered to and scattered from rank 0 (kv.py).
The groups and their rendezvous: group.py; how the ranks of a group prove
the engine's secret to each other: auth.py; a rank's loop: rank.py; ranks as
local processes: local.py; rank 0's side, starting and
stopping the others: setup.py (a serving worker starts them as Ray actors,
worker/tp_ranks.py).
"""
