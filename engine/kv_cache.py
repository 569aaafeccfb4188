"""Paged KV cache: the block pool (ids, reference counts, prefix cache) and
the tensors that hold the keys and values.

A block is ``block_size`` consecutive token slots of one sequence. Blocks
are either

- in use: ref_count > 0, held by one or more sequences (shared prefixes),
- cached: ref_count == 0 but the block is full and has a hash, so a later
  request with the same prefix can take it back; evicted in LRU order only
  when a fresh block is needed,
- free: ref_count == 0 and no hash.

``num_free`` counts free plus cached blocks: everything allocatable. Every
request, finished, aborted or failed, must hand back all its references,
so ``num_free`` returns to its starting value once nothing runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine import hugepages
from engine.hashing import BlockHash


@dataclass(frozen=True)
class KVLayout:
    """What two pools must agree on before KV blocks can move between them."""

    model_fingerprint: str
    dtype: str  # torch dtype name, e.g. "float32"
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    # How blocks travel between pools: "" as dtype, else a quantized encoding
    # (kv_transfer/quantized.py). A pool's own cache always has "".
    wire_dtype: str = ""

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of K plus V of one block in one layer (on the wire, for a wire_dtype)."""
        if self.wire_dtype:
            from kv_transfer.quantized import wire_block_bytes_per_layer

            return wire_block_bytes_per_layer(self, self.wire_dtype)
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_bytes_per_layer * self.num_layers

    def mismatch(self, other: KVLayout) -> str | None:
        """Name of the first field that differs from ``other``, else None."""
        for name in self.__dataclass_fields__:
            if getattr(self, name) != getattr(other, name):
                return name
        return None


class BlockPool:
    """Block ids, reference counts, and the prefix cache over them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # Free blocks without a hash: reused first, lowest id first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks with ref 0, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._block_of: dict[BlockHash, int] = {}
        # Hashes cached (True) or evicted (False) since the last drain; the
        # last change of each hash wins, so a drain is the net change.
        self._changes: dict[BlockHash, bool] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with ref 1 each, or None (and no change) if too few."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block.

        Blocks are released last-first, so a sequence's tail blocks are
        evicted before its head, which other requests are likelier to share.
        """
        for block in reversed(block_ids):
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_counts[block] = count - 1
            if count == 1:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def cache(self, block: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, in-use block under its hash. False if the hash is
        already held by another block (the caller keeps its own copy)."""
        if block in self._hash_of:
            return self._hash_of[block] == block_hash
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._tokens_of[block] = tuple(token_ids)
        self._block_of[block_hash] = block
        self._changes[block_hash] = True
        return True

    def match_prefix(
        self, hashes: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]
    ) -> list[int]:
        """Longest run of cached blocks for ``hashes``; each is taken (ref+1).

        The tokens are compared too, so a hash collision is a miss, never
        wrong output.
        """
        taken: list[int] = []
        for block_hash, tokens in zip(hashes, token_blocks, strict=False):
            block = self._block_of.get(block_hash)
            if block is None or self._tokens_of[block] != tuple(tokens):
                break
            self._take(block)
            taken.append(block)
        return taken

    def block_for_hash(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def tokens_of(self, block: int) -> tuple[int, ...] | None:
        """Token ids of a cached block, None if the block has no hash."""
        return self._tokens_of.get(block)

    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to blocks that are cached or in use."""
        for block in block_ids:
            if self.ref_counts[block] == 0 and block not in self._evictable:
                raise RuntimeError(f"block {block} is neither in use nor cached")
            self._take(block)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed): the net change of the cache since the last drain,
        for the block index."""
        changes, self._changes = self._changes, {}
        stored = [h for h, cached in changes.items() if cached]
        return stored, [h for h, cached in changes.items() if not cached]

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the cache holds now (a snapshot for the block index)."""
        return list(self._block_of)

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        del self._tokens_of[block]
        del self._block_of[block_hash]
        self._changes[block_hash] = False


class KVCache:
    """One preallocated tensor per layer.

    layers[i]: [2, num_blocks, block_size, num_kv_heads, head_dim]
    (index 0 holds keys, 1 values). ``flat(i)`` views the same memory as
    [2, num_blocks * block_size, num_kv_heads, head_dim] for slot writes.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        dtype = getattr(torch, layout.dtype)
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.layers = [
            hugepages.empty(shape, dtype, device).zero_() for _ in range(layout.num_layers)
        ]
        self._flat = [t.view(2, num_blocks * layout.block_size, *shape[3:]) for t in self.layers]

    def flat(self, layer: int) -> torch.Tensor:
        return self._flat[layer]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy of the given blocks: [num_layers, 2, n, block_size, kv_heads, head_dim]."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        return torch.stack([t.index_select(1, idx) for t in self.layers])

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        for layer, t in enumerate(self.layers):
            t.index_copy_(1, idx, data[layer].to(device=t.device, dtype=t.dtype))

    @staticmethod
    def blocks_for_budget(layout: KVLayout, memory_bytes: int) -> int:
        return max(1, memory_bytes // layout.block_bytes)
