"""Which hashes a received transfer's blocks get: never the sender's word.

A push's receiver recomputes every full block's hash from the header's
token ids (engine/hashing.py: rooted in its own model fingerprint and block
size, the request's cache salt as ``extra``); a header that names other
hashes (b"": none named) is refused. A puller asked for hashes it computed
from its own prompt: the header must name those, over the tokens it expects.

KV that crossed the wire quantized (``wire_dtype``) is close to, not equal
to, what the model computes: its blocks are indexed under a salt derived
from the request's and the wire dtype (``cache_salt_for``), so they never
answer a full-precision request's prefix lookup, only those of requests
whose KV came the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import grpc

from engine.hashing import hash_blocks, length_prefixed, root_hash
from engine.kv_layout import KVLayout
from protos.tandem.v1 import kv_transfer_pb2 as pb

from .interface import TransferError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


def cache_salt_for(wire_dtype: str, cache_salt: bytes) -> bytes:
    """The salt a transfer's blocks are indexed under at the receiver."""
    if not wire_dtype:
        return cache_salt
    h = hashlib.blake2b(digest_size=16)
    h.update(b"tandem-wire-salt-v1")
    h.update(length_prefixed(wire_dtype.encode()))
    h.update(length_prefixed(cache_salt))
    return h.digest()


def push_hashes(header: pb.TransferHeader, layout: KVLayout) -> list[bytes]:
    """What a push's blocks are indexed under, one per block (b"": a partial
    last block), recomputed from its tokens; refuse a header whose tokens do
    not cover its blocks or whose hashes are not theirs."""
    n, bs = header.num_blocks, layout.block_size
    tokens = list(header.token_ids)
    if n and not (n - 1) * bs < len(tokens) <= n * bs:
        raise TransferError(
            _INVALID, f"{len(tokens)} token_ids do not cover {n} blocks of {bs} tokens"
        )
    if not n and tokens:
        raise TransferError(_INVALID, f"{len(tokens)} token_ids for no block")
    root = root_hash(layout.model_fingerprint, bs)
    wire = _padded(hash_blocks(tokens, bs, root, header.cache_salt), n)
    named = zip(header.block_hashes, wire, strict=False)  # empty or one per block
    if any(theirs and theirs != ours for theirs, ours in named):
        raise TransferError(_INVALID, "block_hashes are not the hashes of token_ids")
    if not layout.wire_dtype:
        return wire
    salt = cache_salt_for(layout.wire_dtype, header.cache_salt)
    return _padded(hash_blocks(tokens, bs, root, salt), n)


def pulled_hashes(
    header: pb.TransferHeader,
    layout: KVLayout,
    asked: Sequence[bytes],
    token_ids: Sequence[int],
) -> list[bytes]:
    """What a pull's blocks are indexed under, once its header is checked
    against what was asked for: the leading ``num_blocks`` of ``asked``, over
    the leading tokens of ``token_ids`` (the asked blocks' tokens; empty: not
    checked). Quantized KV is not indexed (no parent hash to re-salt a chain
    that starts mid-prompt)."""
    n, bs = header.num_blocks, layout.block_size
    if n > len(asked):
        raise TransferError(_INVALID, f"{n} blocks for {len(asked)} asked")
    if list(header.block_hashes) != list(asked[:n]):
        raise TransferError(_INVALID, "pulled block_hashes are not the ones asked for")
    if token_ids and list(header.token_ids) != list(token_ids[: n * bs]):
        raise TransferError(_INVALID, "pulled token_ids are not the asked blocks' tokens")
    return [b""] * n if layout.wire_dtype else [bytes(h) for h in header.block_hashes]


def _padded(hashes: list, n: int) -> list[bytes]:
    return [bytes(h) for h in hashes] + [b""] * (n - len(hashes))
