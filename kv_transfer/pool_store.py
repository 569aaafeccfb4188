"""``BlockSink`` and ``BlockSource`` over a BlockPool and its KVCache.

Every pool call names the holder of the references (a transfer's lease
holder, see lease.py): reserved, pinned and received blocks are held by
it, and released by it.

Thread-safety: pool bookkeeping runs under ``lock``. Pass the lock the engine
uses around its own pool calls when the engine runs in another thread than
the transfer server; with both on one asyncio loop no lock is needed. Tensor
copies run outside the lock: a transfer only touches blocks it reserved or
pinned, which nobody else writes.

A cache in host memory is sent from and received into its own blocks
(``buffers``). A cache on a GPU goes device -> page-locked host buffer ->
wire -> page-locked host buffer -> device (``staging_buffer``, ``read_into``,
``write``), the copies on a stream of their own that first waits for the
engine's queued work.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from engine.block_pool import BlockPool, Holder
from engine.device import host_buffer
from engine.hashing import BlockHash
from engine.kv_cache import KVCache

from .wire import tensor_view


class PoolBlockStore:
    def __init__(
        self, pool: BlockPool, cache: KVCache, lock: threading.RLock | None = None
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.layout = cache.layout
        self.lock = lock if lock is not None else threading.RLock()
        self._dtype = cache.layers[0].dtype
        # One block of one layer: [2, 1, block_size, kv_heads, head_dim].
        self._block_shape = (2, 1, *cache.layers[0].shape[2:])
        # Each layer's bytes, for ``buffers``; None where they are not in
        # ordinary contiguous host memory (an accelerator's cache).
        self._layer_bytes: list[memoryview] | None = None
        if all(t.device.type == "cpu" and t.is_contiguous() for t in cache.layers):
            self._layer_bytes = [
                memoryview(t.view(-1).view(torch.uint8).numpy()) for t in cache.layers
            ]
        self._half_block_bytes = self.layout.block_bytes_per_layer // 2  # K or V of one block
        self._device = cache.layers[0].device
        self._copies = _CopyStream(self._device)
        self.admit: Callable[[Holder, int], bool] | None = None
        """When set (a decode worker's reserve), ``reserve`` takes blocks only
        if ``admit(holder, n)``, called under ``lock``."""
        self.on_held: Callable[[Holder], None] | None = None
        """When set (a decode worker's reserve): called under ``lock`` after
        ``reserve``, ``hold_prefix`` or ``release`` changed what a holder holds."""

    @property
    def num_free(self) -> int:
        with self.lock:
            return self.pool.num_free

    def holders(self) -> list[Holder]:
        with self.lock:
            return self.pool.holders()

    # BlockSink

    def reserve(self, holder: Holder, n: int) -> list[int] | None:
        with self.lock:
            if self.admit is not None and not self.admit(holder, n):
                return None
            blocks = self.pool.allocate(holder, n)
            self._changed(holder)
            return blocks

    def write(self, block_ids: Sequence[int], layer_start: int, data: memoryview) -> None:
        src = self._layers_view(block_ids, data)
        with self._copies.active():
            idx = self._index(block_ids)  # on the copies' stream, like every copy here
            for i, layer_src in enumerate(src):
                # layer: [2, num_blocks, block_size, kv_heads, head_dim]
                layer_src = self._copies.to_device(layer_src)
                self.cache.layers[layer_start + i].index_copy_(1, idx, layer_src)

    def commit(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes | None],
        token_ids: Sequence[int],
    ) -> None:
        bs = self.layout.block_size
        with self.lock:
            for i, (block, block_hash) in enumerate(zip(block_ids, block_hashes, strict=True)):
                tokens = token_ids[i * bs : (i + 1) * bs]
                if block_hash and len(tokens) == bs:
                    self.pool.cache(block, BlockHash(block_hash), tokens)

    def hold_prefix(
        self, holder: Holder, block_hashes: Sequence[bytes], token_ids: Sequence[int]
    ) -> list[int]:
        bs = self.layout.block_size
        token_blocks = [token_ids[i * bs : (i + 1) * bs] for i in range(len(block_hashes))]
        hashes = [BlockHash(h) for h in block_hashes]
        with self.lock:
            blocks = self.pool.match_prefix(holder, hashes, token_blocks)
            self._changed(holder)
            return blocks

    def release(self, holder: Holder, block_ids: Sequence[int] | None = None) -> None:
        with self.lock:
            self.pool.release(holder, block_ids)
            self._changed(holder)

    def _changed(self, holder: Holder) -> None:
        if self.on_held is not None:
            self.on_held(holder)

    # BlockSource

    def pin(self, holder: Holder, block_ids: Sequence[int]) -> None:
        with self.lock:
            self.pool.acquire(holder, block_ids)

    def pin_hashes(
        self, holder: Holder, block_hashes: Sequence[bytes]
    ) -> tuple[list[int], list[int]]:
        with self.lock:
            blocks: list[int] = []
            tokens: list[int] = []
            for block_hash in block_hashes:
                block = self.pool.block_for_hash(BlockHash(block_hash))
                if block is None:
                    break
                blocks.append(block)
                tokens.extend(self.pool.tokens_of(block) or ())
            self.pool.acquire(holder, blocks)
            return blocks, tokens

    def read_into(
        self,
        block_ids: Sequence[int],
        layer_start: int,
        layer_end: int,
        out: memoryview,
        computed: bool = False,
    ) -> None:
        dst = self._layers_view(block_ids, out)
        with self._copies.active(after_engine=not computed):
            # on the copies' stream: made on the engine's, this copy would wait
            # for everything queued there, which ``computed`` is meant to skip
            idx = self._index(block_ids)
            for i, layer_dst in enumerate(dst[: layer_end - layer_start]):
                layer = self.cache.layers[layer_start + i]
                if self._device.type == "cpu":
                    torch.index_select(layer, 1, idx, out=layer_dst)
                else:
                    self._copies.to_host(layer.index_select(1, idx), layer_dst)

    def staging_buffer(self, nbytes: int) -> memoryview:
        """A host buffer for chunks that cannot be read or written in place:
        page-locked when the cache is on a GPU."""
        return host_buffer(nbytes, self._device)

    # Both

    def buffers(
        self, block_ids: Sequence[int], layer_start: int, layer_end: int
    ) -> list[memoryview] | None:
        """Views of the blocks' memory laid out as a chunk's payload (see
        kv_transfer.proto): for each layer, K then V, each over the blocks in
        order, one view per run of consecutive ids. Writing through them
        writes the blocks. None when the cache is not in host memory."""
        if self._layer_bytes is None:
            return None
        runs = _runs(block_ids)
        size = self._half_block_bytes
        values_at = self.cache.num_blocks
        views = []
        for layer in self._layer_bytes[layer_start:layer_end]:
            for base in (0, values_at):
                for first, count in runs:
                    lo = (base + first) * size
                    views.append(layer[lo : lo + count * size])
        return views

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long).to(self._device)

    def _layers_view(self, block_ids: Sequence[int], buf: memoryview) -> torch.Tensor:
        """``buf`` as [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        shape = (2, len(block_ids), *self._block_shape[2:])
        return tensor_view(buf, self._dtype).view(-1, *shape)


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, length) of each run of consecutive ids, in order."""
    runs: list[list[int]] = []
    for block in block_ids:
        if runs and block == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([block, 1])
    return [(first, count) for first, count in runs]


class _CopyStream:
    """Runs transfer copies on a CUDA stream of their own (nothing to do on
    the host). ``active()`` first waits for the work the engine queued so far
    (the blocks it wrote; not for blocks known computed) and at the end for
    the copies, so host buffers can be reused and blocks are complete before
    they are committed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def active(self, after_engine: bool = True) -> Iterator[None]:
        """``after_engine``: first wait for the work queued on the engine's
        stream (off for blocks known computed)."""
        if self._stream is None:
            yield
            return
        if after_engine:
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host
        return host.to(self.device, non_blocking=host.is_pinned())

    def to_host(self, device_tensor: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(device_tensor, non_blocking=out.is_pinned())
