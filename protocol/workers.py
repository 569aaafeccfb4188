"""What a worker tells the router about itself: identity and addresses,
counters, health.

Torch-free. Today the workers answer ``start`` and ``stats`` with dicts
(worker/base.py ``describe``/``stats``, prefill_pool/worker.py,
decode_pool/worker.py ``WorkerAddresses``, engine/spec/decoder.py
``spec_stats``); ``WorkerInfo.from_dict`` and ``WorkerStats.from_dict`` read
those dicts and ``to_dict`` writes them, so either side can move to the
types first. ``WorkerHealth`` is already what ``health`` returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_INFO_KEYS = {"kv_address": "kv"}  # field -> key in today's dicts, where they differ


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

    @property
    def serves_outputs(self) -> bool:
        """A decode or colocated worker: the router reads its tokens from it."""
        return self.outputs is not None

    @classmethod
    def from_dict(cls, info: Mapping[str, Any]) -> WorkerInfo:
        """From today's ``start`` answer: ``describe()`` (with ``kv``), and for
        decode workers ``WorkerAddresses`` merged in. Empty addresses become
        None; unknown keys are ignored (a newer worker may send more)."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = _INFO_KEYS.get(f.name, f.name)
            if key in info:
                kwargs[f.name] = info[key]
        missing = [f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in kwargs]
        if missing:
            raise ValueError(f"worker info lacks {', '.join(missing)}")
        for name in ("kv_address", "outputs", "outputs_local", "host_id"):
            if not kwargs.get(name):
                kwargs[name] = None
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Today's dict shape: addresses a worker lacks are left out, except that
        a worker with ``outputs`` always has ``outputs_local`` and ``host_id``
        ('' when none), as ``WorkerAddresses`` does."""
        out: dict[str, Any] = {
            "name": self.name,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "model_fingerprint": self.model_fingerprint,
            "incarnation": self.incarnation,
        }
        if self.kv_address is not None:
            out["kv"] = self.kv_address
        if self.outputs is not None:
            out["outputs"] = self.outputs
            out["outputs_local"] = self.outputs_local or ""
            out["host_id"] = self.host_id or ""
        return out


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
    spec_proposed_tokens: int = 0
    """Speculative decoding: proposed tokens the target verified (0 without speculation)."""
    spec_accepted_tokens: int = 0
    """Speculative decoding: proposed tokens the target model accepted."""
    spec_emitted_tokens: int = 0
    """Speculative decoding: tokens its steps emitted (the accepted ones + one per step)."""
    kv_bytes_pushed: int = 0
    """Prefill workers: KV bytes pushed to decode workers (0 on others)."""
    kv_bytes_pulled: int = 0
    """Prefill workers: KV bytes pulled from other workers' prefix caches."""

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def idle(self) -> bool:
        """No requests and every block it started with free again."""
        return self.num_requests == 0 and self.free_blocks == self.initial_free_blocks

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None before any proposal."""
        if not self.spec_proposed_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_proposed_tokens

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any]) -> WorkerStats:
        """From today's ``stats()`` dict. Unknown keys (the router adds ``role``)
        are ignored; a missing counter of the base set is an error."""
        kwargs = {f.name: stats[f.name] for f in dataclasses.fields(cls) if f.name in stats}
        missing = [f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in kwargs]
        if missing:
            raise ValueError(f"worker stats lack {', '.join(missing)}")
        for name, value in kwargs.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"worker stats: {name} must be an int, got {value!r}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class WorkerHealth:
    """A worker's answer to a health check (its engine thread answered too)."""

    name: str
    incarnation: str  # new each time the actor process starts (Ray restarts it)
    started: bool  # start() has run in this incarnation
    free_blocks: int
    initial_free_blocks: int
    num_requests: int


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
