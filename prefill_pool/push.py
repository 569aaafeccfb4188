"""What a prefill worker's push of one request is made of.

The header is known when the request arrives: the tokens whose KV the
blocks will hold (the prompt, and the outputs of a resumed request), their
hashes, and what the decode worker checks before it reserves a block
(protocol/decode_start.py's ``DecodeStart``). The blocks come from a
``KVFeed`` (kv_transfer/feed.py) as the engine computes them. The commit
carries the first token (``FirstToken``), known only once the prefill is
done.
"""

from __future__ import annotations

import threading

from engine.hashing import hash_blocks, root_hash
from engine.kv_layout import KVLayout
from kv_transfer.feed import Final, KVFeed
from kv_transfer.interface import BlockSource, PushHeader
from protocol.decode_start import DecodeStart, FirstToken
from protocol.outputs import RequestOutput
from protocol.requests import PrefillRequest


def pushed_tokens(req: PrefillRequest) -> list[int]:
    """The tokens whose KV the push carries: all the engine computes."""
    return req.prompt_token_ids + req.output_token_ids


def ends_at_first_token(req: PrefillRequest, max_model_len: int) -> bool:
    """Whether the token the prefill samples ends the request whatever it is
    (its last by max_tokens, or the model's length): then no block moves."""
    outputs = len(req.output_token_ids) + 1
    return outputs >= req.params.max_tokens or len(pushed_tokens(req)) + 1 >= max_model_len


def push_header(req: PrefillRequest, layout: KVLayout) -> PushHeader:
    tokens = pushed_tokens(req)
    bs = layout.block_size
    hashes = hash_blocks(tokens, bs, root_hash(layout.model_fingerprint, bs), req.cache_salt)
    partial = [None] * (-(-len(tokens) // bs) - len(hashes))
    start = DecodeStart(req.router_id, len(req.prompt_token_ids), req.params)
    return PushHeader(
        req.request_id,
        tokens,
        [bytes(h) for h in hashes] + partial,
        start.encode(),
        req.cache_salt,
        req.push_grant,
    )


def push_feed(
    req: PrefillRequest, source: BlockSource, lock: threading.RLock, max_model_len: int
) -> KVFeed:
    """The feed of the request's KV (none when its first token ends it)."""
    n = 0 if ends_at_first_token(req, max_model_len) else len(pushed_tokens(req))
    return KVFeed.for_request(source, lock, req.request_id, n)


def first_token(out: RequestOutput) -> Final:
    """What the commit carries: the sampled token and its details."""
    first = FirstToken(
        out.text_delta,
        out.logprobs,
        out.num_cached_tokens,
        out.num_output_tokens,
        out.finish_reason if out.finished else None,
    )
    return Final(tuple(out.new_token_ids), first.encode())
