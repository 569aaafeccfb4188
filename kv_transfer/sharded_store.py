"""``PoolBlockStore`` over a tensor-parallel engine's pool.

The block pool is rank 0's; the blocks' data is split over the ranks' caches
by kv head. A chunk carries every head of its blocks, in order, as from a
worker of one rank (kv_transfer.proto), so this store gathers each chunk's
heads from every rank before it goes out and scatters them after it came in
(engine/parallel/kv.py, over the ranks' own group, on rank 0's side). A
prefill worker at tensor_parallel_size a thus pushes to a decode worker at
b, whatever a and b: the layout header names each side's split, and the
receiver refuses only one that is not even (engine/kv_layout.py).

Why through rank 0, and not rank to rank: one endpoint per worker keeps the
authentication, the grants, the leases and the block bookkeeping where they
are (rank 0 owns the pool); the cost is a copy of every chunk through rank 0
on each side, over loopback or the machine's own interconnect.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from engine.block_pool import BlockPool
from engine.kv_cache import KVCache
from engine.parallel.kv import ShardedKV

from .pool_store import PoolBlockStore
from .wire import tensor_view


class ShardedBlockStore(PoolBlockStore):
    def __init__(
        self,
        pool: BlockPool,
        cache: KVCache,
        kv: ShardedKV,
        lock: threading.RLock | None = None,
    ) -> None:
        super().__init__(pool, cache, lock)
        self.kv = kv
        self._layer_bytes = None  # no chunk is sent from or received into the blocks in place
        layout = self.layout
        self._whole_block = (layout.block_size, layout.num_kv_heads, layout.head_dim)

    def read_into(
        self,
        block_ids: Sequence[int],
        layer_start: int,
        layer_end: int,
        out: memoryview,
        computed: bool = False,  # every rank's read is ordered after its own work
    ) -> None:
        data = self.kv.read(block_ids, layer_start, layer_end)
        tensor_view(out, self._dtype).view(data.shape).copy_(data)

    def write(self, block_ids: Sequence[int], layer_start: int, data: memoryview) -> None:
        # [layers, 2, blocks, block_size, num_kv_heads, head_dim], every head
        values = tensor_view(data, self._dtype).view(-1, 2, len(block_ids), *self._whole_block)
        self.kv.write(block_ids, layer_start, values)
