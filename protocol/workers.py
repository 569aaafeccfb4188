"""What a worker tells the router about itself: identity and addresses
(``WorkerInfo``, its actor's ``start``), counters (``WorkerStats``,
``stats``) and health (``WorkerHealth``, ``health``). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    """What the router needs to know about a worker, from its actor's ``start``.

    Every worker has the identity fields and a KV transfer service; decode
    and colocated workers also serve output streams.
    """

    name: str
    """The worker's name in its pool (``prefill-0``, ``decode-1``, ...)."""
    max_model_len: int
    """Longest sequence (prompt + output tokens) its engine takes."""
    vocab_size: int
    """The model's vocabulary; token ids must be below it."""
    model_fingerprint: str
    """Identifies the weights and KV layout: workers that share it can exchange
    KV blocks, and it roots the prefix-cache block hashes (engine/hashing.py)."""
    incarnation: str
    """New each time the actor process starts (Ray restarts it): a health
    answer from another incarnation is from a worker that lost its state."""
    model_dir: str
    """The checkpoint directory the worker loaded (the embedded default model
    is built there on first use): the router reads the tokenizer from it."""
    kv_address: str | None = None
    """``host:port`` of its KVTransfer service (kv_transfer/): a prefill worker
    serves pulls of its cached blocks there, a decode worker receives pushes;
    None: none."""
    outputs: str | None = None
    """``host:port`` of its output streams (worker/output_wire.py), which
    routers subscribe to; None: a prefill worker, which has none."""
    outputs_local: str | None = None
    """The same streams on a Unix socket, for routers on the same machine;
    None: not offered."""
    host_id: str | None = None
    """Who can reach ``outputs_local`` (net/local_socket.py ``host_identity``):
    a router uses the socket only when its own identity is this one."""
    eos_token_ids: tuple[int, ...] = ()
    """The engine's end-of-sequence tokens (the model's and its tokenizer's):
    the router checks a client's resumed tokens against them (router/resume.py)."""
    started: bool = True
    """False: its actor has not finished ``start`` (an ``info`` answer from a
    worker being created, or one Ray restarted); a router does not route to it."""


@dataclass(frozen=True)
class WorkerStats:
    """A worker's counters, from its actor's ``stats`` (the router's metrics,
    admin status and ``tandem bench`` read them). Counts are since the
    actor process started."""

    free_blocks: int
    """KV blocks free in its pool now (cached blocks nobody uses count as free)."""
    total_blocks: int
    """KV blocks in its pool."""
    initial_free_blocks: int
    """Free blocks when the worker was built (before any request)."""
    num_holders: int
    """Holders of KV block references in its pool (engine/block_pool.py)."""
    initial_num_holders: int
    """Holders when the worker was built (the engine's own, e.g. a scratch block)."""
    num_requests: int
    """Requests the engine holds (running, waiting, or prefilled and awaiting export)."""
    num_running: int
    """Sequences in the running batch."""
    num_waiting: int
    """Sequences queued for admission."""
    num_steps: int
    """Engine steps run."""
    num_preemptions: int
    """Sequences preempted for blocks (recomputed later)."""
    num_push_preemptions: int = 0
    """Of those, preemptions while a KV push held reserved blocks here (an upper
    bound on those a push caused; a decode worker's reserve keeps it at 0)."""
    spec_proposed_tokens: int = 0
    """Speculative decoding: proposed tokens the target verified (0 without speculation)."""
    spec_accepted_tokens: int = 0
    """Speculative decoding: proposed tokens the target model accepted."""
    spec_emitted_tokens: int = 0
    """Speculative decoding: tokens its steps emitted (the accepted ones + one per step)."""
    num_expected_pushes: int = 0
    """Decode workers: KV pushes accepted (``PushReserve``) whose requests have
    not joined the batch yet (0 on others)."""
    num_transfer_leases: int = 0
    """KV transfers its server holds blocks for now (open leases, kv_transfer/lease.py)."""
    kv_bytes_pushed: int = 0
    """Prefill workers: KV bytes pushed to decode workers (0 on others)."""
    kv_bytes_pulled: int = 0
    """Prefill workers: KV bytes pulled from other workers' prefix caches."""
    kv_cached_blocks: int = 0
    """Device tier: blocks its prefix cache holds now (in use or not)."""
    kv_prefix_hit_blocks: int = 0
    """Device tier: prefix blocks requests found in the pool."""
    kv_tier_capacity_blocks: int = 0
    """Host tier (engine.kv_tier_mb): its size in blocks; 0 without one."""
    kv_tier_blocks: int = 0
    """Host tier: blocks it holds now."""
    kv_tier_hit_blocks: int = 0
    """Host tier: prefix blocks copied back into the pool instead of computed."""
    kv_tier_bytes_in: int = 0
    """Host tier: bytes copied to it from the pool (evicted blocks)."""
    kv_tier_bytes_out: int = 0
    """Host tier: bytes copied from it back into the pool (prefix hits)."""

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def idle(self) -> bool:
        """No requests, no holder beyond the engine's own, and every block it
        started with free again: what every request must leave behind."""
        return (
            self.num_requests == 0
            and self.num_holders == self.initial_num_holders
            and self.free_blocks == self.initial_free_blocks
        )

    @property
    def holds_no_request(self) -> bool:
        """No request, no push expected and no transfer open: a worker that may
        stop without failing anything (router/pool_controller.py retires it)."""
        return (
            self.num_requests == 0
            and self.num_expected_pushes == 0
            and self.num_transfer_leases == 0
        )

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None before any proposal."""
        if not self.spec_proposed_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_proposed_tokens


@dataclass(frozen=True)
class CachedBlocks:
    """A worker's answer to ``cached_blocks``: the hashes of every block its
    prefix cache holds now (the router reconciles its block index with them,
    block_index/reconcile.py)."""

    worker: str
    hashes: tuple[bytes, ...]


UNHEALTHY_FAILED_STEPS = 3
"""A worker whose last this many engine steps failed for no one request
(engine/request_faults.py) answers its health check as failing
(``WorkerHealth.failing``), and the router takes it out of routing
(router/health.py)."""

FAILING_WINDOW_S = 30.0
"""Failed steps count only while the last of them is younger than this: an
engine out of routing gets no requests, so no step of its can pass, and
without the window it would stay failing for good. After it the worker
answers healthy again and the router takes it back; one more failed step
there makes it failing at once (the count goes on from where it was until a
step passes). Shorter than ``pools.worker_recovery_timeout_s`` (120 s by
default), or the router gives the worker up first."""


@dataclass(frozen=True)
class WorkerHealth:
    """A worker's answer to a health check (its engine thread answered too)."""

    name: str
    incarnation: str  # new each time the actor process starts (Ray restarts it)
    started: bool  # start() has run in this incarnation
    free_blocks: int
    initial_free_blocks: int
    num_requests: int
    failed_steps: int = 0
    """Engine steps in a row that failed for no one request, while the last of
    them is under ``FAILING_WINDOW_S`` old (0 after a step that passed, and
    once the window is over)."""

    @property
    def failing(self) -> bool:
        """Its steps keep failing: it must not get requests."""
        return self.failed_steps >= UNHEALTHY_FAILED_STEPS
