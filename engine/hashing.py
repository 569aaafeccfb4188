"""The block hash chain: the only block hash in tandem.

h_0 = root(model fingerprint, block size)
h_i = H(h_{i-1}, token ids of block i, extra)

Only full blocks are hashed. The hash is blake2b-128 over fixed-width
little-endian token ids, so it is the same in every process and on every
machine (Python's ``hash()`` is salted per process and is never used).
Workers, the router and the block index all import these functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)

DIGEST_SIZE = 16
_HASH_VERSION = b"tandem-block-hash-v1"


def length_prefixed(data: bytes) -> bytes:
    """``data`` after its length (4 bytes, little-endian): the field encoding of
    every MAC and digest input in tandem, so no two tuples give the same bytes."""
    return len(data).to_bytes(4, "little") + data


def root_hash(model_fingerprint: str, block_size: int) -> BlockHash:
    """The chain's root: binds the model and the block size."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(_HASH_VERSION)
    h.update(model_fingerprint.encode())
    h.update(block_size.to_bytes(4, "little"))
    return BlockHash(h.digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    h.update(length_prefixed(extra))
    return BlockHash(h.digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    extra: bytes = b"",
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start`` on.

    ``parent`` is the hash of block ``start - 1`` (the root when start is 0).
    A trailing partial block gets no hash.
    """
    hashes: list[BlockHash] = []
    prev = root if parent is None else parent
    for i in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(prev)
    return hashes
