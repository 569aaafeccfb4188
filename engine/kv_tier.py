"""The second KV tier: where blocks evicted from the device pool go, and
where a later prefix hit finds them instead of computing them again.

The block pool (engine/block_pool.py) stays the one owner of block
references; this tier holds copies of cached blocks' data, keyed by the
same block hash chain, and no reference at all. When the pool evicts a
cached block (its least recently used unreferenced one) to hand out a
fresh block, it first asks the tier to ``spill`` it; when a request's
prefix runs past what the device pool caches, the pool allocates a fresh
block and asks the tier to ``restore`` the next hash into it.

Storage:

- behind a GPU pool: pinned host memory (``torch.empty(pin_memory=True)``),
- behind a CPU pool: a memory-mapped file (``mapped_file``), so the tier can
  be larger than RAM: the kernel writes cold pages back to the file. The
  file is created 0600 in ``directory`` (default
  ``$XDG_STATE_HOME/tandem/kv-tier``; it must be the worker's own and not
  group- or world-writable), unlinked at once, its whole size reserved on
  disk (``posix_fallocate``: no room fails at start-up, not mid-step) and
  mapped through its open descriptor: the mapping keeps it alive until the
  process ends, a stopped or killed worker leaves nothing behind, and a
  restarted worker starts with an empty tier (it never reads a previous
  one's content).

Each entry keeps the block's token ids and a blake2b digest of its bytes:
a hit checks both, so a hash collision, a stale entry or corrupted bytes
cost a miss (the block is computed), never wrong output. The tier is
inclusive: a restored block keeps its entry, so evicting it again moves
no bytes. It has its own size and its own LRU order.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.hashing import BlockHash
from engine.kv_cache import KVCache


@dataclass
class TierStats:
    """What one tier did: the per-tier metrics a worker reports."""

    capacity_blocks: int = 0
    blocks: int = 0  # entries held now
    hits: int = 0  # blocks restored into the device pool
    rejected: int = 0  # entries whose tokens or digest did not match (dropped)
    spilled: int = 0  # blocks copied in from the device pool
    evicted: int = 0  # entries dropped for room
    bytes_in: int = 0  # bytes copied device pool -> tier
    bytes_out: int = 0  # bytes copied tier -> device pool


@dataclass(frozen=True, slots=True)
class _Entry:
    slot: int
    tokens: tuple[int, ...]
    digest: bytes


def default_directory() -> Path:
    """$XDG_STATE_HOME/tandem/kv-tier (~/.local/state/... without XDG_STATE_HOME)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tandem" / "kv-tier"


def mapped_file(directory: Path, nbytes: int) -> torch.Tensor:
    """``nbytes`` of a new file in ``directory`` (0600), its disk space
    reserved, mapped shared and unlinked at once; a uint8 tensor over the
    mapping.

    ``directory`` (created 0700 if missing) must be a directory this process
    owns that no group or other user may write: the file is created in it by
    name (O_EXCL) and mapped through the descriptor it was opened with, never
    reopened by path. Raises ``OSError`` when the disk lacks room for the
    whole tier: a sparse file would fail later, mid-step, with SIGBUS."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _check_private(directory, os.fstat(dir_fd))
        name = f"kv-tier-{os.getpid()}-{uuid.uuid4().hex[:12]}.bin"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
            _reserve(fd, nbytes, directory)
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file
    finally:
        os.close(dir_fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive


def _check_private(directory: Path, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"kv_tier_dir {directory} is owned by uid {st.st_uid}, not by this worker "
            f"(uid {os.geteuid()}): choose a directory the worker owns"
        )
    if st.st_mode & 0o022:
        raise PermissionError(
            f"kv_tier_dir {directory} is writable by group or others "
            f"(mode {stat.filemode(st.st_mode)}): make it 0700 or choose another"
        )


def _reserve(fd: int, nbytes: int, directory: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot reserve {nbytes} bytes for the KV tier in {directory}: {e.strerror} "
            "(lower engine.kv_tier_mb or choose another kv_tier_dir)",
        ) from e


class KVTier:
    """A second tier of ``num_blocks`` blocks behind ``cache``'s pool."""

    def __init__(self, cache: KVCache, num_blocks: int, directory: str | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV tier needs >= 1 block, got {num_blocks}")
        layout = cache.layout
        self.cache = cache
        self.block_bytes = layout.block_bytes
        self._dtype = getattr(torch, layout.dtype)
        self._shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                       layout.head_dim)  # fmt: skip
        nbytes = num_blocks * self.block_bytes
        if cache.layers[0].device.type == "cuda":
            self.medium = "pinned"
            self.storage = torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8,
                                       pin_memory=True)  # fmt: skip
        else:
            self.medium = "file"
            where = Path(directory) if directory else default_directory()
            self.storage = mapped_file(where, nbytes).view(num_blocks, self.block_bytes)
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU first
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._changed: set[BlockHash] = set()
        self.stats = TierStats(capacity_blocks=num_blocks)

    @property
    def capacity(self) -> int:
        return self.stats.capacity_blocks

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[BlockHash]:
        return list(self._entries)

    def has(self, block_hash: BlockHash, tokens: Sequence[int]) -> bool:
        """An entry for ``block_hash`` with these tokens (its bytes not checked
        yet); a found one becomes the most recently used, so the spill that
        makes room for its restore does not evict it."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.tokens != tuple(tokens):
            return False
        self._entries.move_to_end(block_hash)
        return True

    # ---- moves --------------------------------------------------------------

    def spill(self, block: int, block_hash: BlockHash, tokens: Sequence[int]) -> None:
        """Keep a copy of device block ``block`` (cached as ``block_hash``)."""
        entry = self._entries.get(block_hash)
        if entry is not None and entry.tokens == tuple(tokens):
            self._entries.move_to_end(block_hash)  # inclusive: the bytes are there
            return
        if entry is not None:
            self._drop(block_hash)
        slot = self._free_slots.pop() if self._free_slots else self._evict_lru()
        view = self._view(slot)
        for layer, t in enumerate(self.cache.layers):
            view[layer].copy_(t[:, block])
        self._entries[block_hash] = _Entry(slot, tuple(tokens), self._digest(slot))
        self._changed.add(block_hash)
        self.stats.spilled += 1
        self.stats.bytes_in += self.block_bytes
        self.stats.blocks = len(self._entries)

    def restore(self, block_hash: BlockHash, tokens: Sequence[int], block: int) -> bool:
        """Copy the entry of ``block_hash`` into device block ``block``; False
        (and nothing written) when there is none with these tokens and bytes."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.tokens != tuple(tokens):
            return False
        if self._digest(entry.slot) != entry.digest:
            self.stats.rejected += 1
            self._drop(block_hash)
            return False
        view = self._view(entry.slot)
        for layer, t in enumerate(self.cache.layers):
            t[:, block].copy_(view[layer])
        self._entries.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.bytes_out += self.block_bytes
        return True

    def discard(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` (its KV is suspect)."""
        if block_hash in self._entries:
            self._drop(block_hash)

    def drain_changed(self) -> set[BlockHash]:
        """Hashes the tier gained or lost since the last drain."""
        changed, self._changed = self._changed, set()
        return changed

    def close(self) -> None:
        """Drop every entry and the storage (the file's mapping goes with it)."""
        self._changed.update(self._entries)
        self._entries.clear()
        self._free_slots = []
        self.storage = torch.empty((0, self.block_bytes), dtype=torch.uint8)
        self.stats.blocks = 0

    # ---- internals ----------------------------------------------------------

    def _view(self, slot: int) -> torch.Tensor:
        return self.storage[slot].view(self._dtype).view(self._shape)

    def _digest(self, slot: int) -> bytes:
        return hashlib.blake2b(self.storage[slot].numpy(), digest_size=16).digest()

    def _evict_lru(self) -> int:
        block_hash, entry = self._entries.popitem(last=False)
        self._changed.add(block_hash)
        self.stats.evicted += 1
        return entry.slot

    def _drop(self, block_hash: BlockHash) -> None:
        entry = self._entries.pop(block_hash)
        self._free_slots.append(entry.slot)
        self._changed.add(block_hash)
        self.stats.blocks = len(self._entries)
