"""The router's calls to the workers, one per try: a prefill worker's
``prefill`` (disaggregated) or a decode worker's ``start_full`` (colocated,
or a short tail after a prefix the decode worker holds)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.sampling import SamplingParams


@dataclass(frozen=True)
class DecodeRequest:
    """Prefill and decode a request on one decode worker."""

    request_id: str
    router_id: str  # whose output stream gets the tokens
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens streamed before this try (after a failover)
    params: SamplingParams
    cache_salt: bytes = b""  # the prefix-cache domain: every block hash of it uses it


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill a request and push it, with its KV, to a decode worker."""

    request_id: str
    router_id: str  # whose output stream the decode worker sends the tokens to
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_kv_address: str  # where to push the blocks
    pull_from: str | None = None  # KV address of a worker holding more of the prefix
    pull_hashes: list[bytes] = field(default_factory=list)  # the blocks to fetch from it
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens already streamed to the client (a failover resumes the request):
    computed with the prompt; the token sampled here is the next one."""
    cache_salt: bytes = b""
    """The request's prefix-cache domain: every block hash of it uses it
    (engine/hashing.py's ``extra``); empty: the default domain."""
    push_grant: bytes = field(default=b"", repr=False)
    """The router's grant for the push to ``decode_kv_address`` (net/grants.py)."""
    pull_grant: bytes = field(default=b"", repr=False)
    """The router's grant for the pull of ``pull_hashes`` from ``pull_from``."""


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill cost; the request's tokens come from the decode worker."""

    request_id: str
    aborted: bool  # the request was dropped here: nothing was pushed
    kv_bytes: int
    held_blocks: int  # leading blocks the decode worker held already: not pushed
    prefill_s: float  # queue + compute, seconds
    transfer_s: float
    events_seq: int = 0
    """Batches of cache events this worker's output streams had carried when
    it replied (those of this prefill included): the router waits for its
    stream to show this count before it ends the request. 0: none (or the
    index is in Redis)."""
