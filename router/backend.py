"""What the router's gRPC service needs from whatever serves requests.

The service validates, tokenizes, admits and streams; a backend runs the
request. ``RayBackend`` (router/ray_backend.py) runs it on prefill and
decode pools; tests use a fake with the same interface.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from protocol.outputs import TokenLogprobs
from protocol.sampling import SamplingParams
from protocol.workers import WorkerStats

from .backpressure import UnreadOutput


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    received_s: float = field(default_factory=time.perf_counter)
    """When the router received the request (``time.perf_counter``): the one
    clock TTFT is measured on, tokenization included."""
    cache_salt: bytes = b""
    """The request's prefix-cache domain (router/tenancy.py), mixed into every
    block hash; empty: the default domain."""
    resume_token_ids: list[int] = field(default_factory=list)
    """Tokens a client already received from a router it lost (router/resume.py):
    generation goes on after them, and they count as completion tokens."""
    resumed_finish: str | None = None
    """The finish reason ``resume_token_ids`` already reached: the request ends
    at once, with no new token. None: it goes on."""
    priority: int = 0
    """Its place in the router's admission queue (router/admission.py): higher
    first, first come first served within a priority."""
    unread: UnreadOutput = field(default_factory=UnreadOutput, compare=False)
    """What the client has not accepted yet, and its bound (router/backpressure.py);
    the front that writes to the client sets it, shared by the request's tries."""


@dataclass
class TokenDelta:
    """New tokens of one request (usually one decode step's worth)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class GenerateResult:
    """The last thing a backend yields for a request."""

    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    mean_tpot_s: float
    prefill_worker: str
    decode_worker: str
    kv_transfer_bytes: int = 0
    kv_transfer_s: float | None = None  # None: no KV push (colocated, or ended at once)
    predicted_cached_tokens: int = 0
    """The prefix hit the router's block index predicted when it routed the
    request (``cached_tokens`` is the hit the worker realized)."""
    available_cached_tokens: int = 0
    """The hit the index said the best-placed worker could give (more than
    ``predicted_cached_tokens``: routing chose another worker, for load or room)."""


@dataclass(frozen=True)
class WorkerReport:
    """One worker in routing, as the router sees it."""

    name: str
    role: str  # "prefill" | "decode" | "colocated"
    in_flight: int  # this router's tries on it now
    stats: WorkerStats


class PlacementTimeout(Exception):
    """New workers were not placed and started in time (``pools.placement_timeout_s``):
    Ray found no node with their resources, or they started too slowly. The
    workers not started were removed; the pools keep the sizes in the message."""


@runtime_checkable
class ManagedPools(Protocol):
    """What a backend with worker pools offers beyond serving (the Admin
    service's Scale and Status, the HTTP front's worker metrics)."""

    async def scale(
        self, prefill: int | None, decode: int | None, drain_timeout_s: float
    ) -> tuple[int, int]:
        """Resize the pools; ValueError for a size the mode does not allow,
        PlacementTimeout when new workers cannot be placed in time."""
        ...

    async def worker_reports(self) -> list[WorkerReport]: ...


@runtime_checkable
class ReconcilesIndex(Protocol):
    """A backend whose block index can be checked against its workers' blocks
    (router/index_reconcile.py; the Admin service's ReconcileIndex)."""

    reconciler: Any  # a router.index_reconcile.IndexReconciler


class Backend(Protocol):
    model_name: str  # the served model name (GetModelInfo, /v1/models)
    tokenizer: Any  # a router.tokenizer.RouterTokenizer, or None (token-id prompts only)
    max_model_len: int  # known once started
    vocab_size: int  # known once started
    block_size: int  # tokens per KV-cache block
    eos_token_ids: frozenset[int]  # the model's end tokens, known once started

    def generate(self, inp: GenerateInput) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Yields deltas, then one GenerateResult. Closing the iterator early
        (client cancel, deadline) aborts the request on every worker and
        frees its blocks."""
        ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...
