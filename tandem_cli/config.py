"""Deployment configuration: flags or a YAML file, validated."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class WorkerResources(BaseModel):
    """Resources of one worker actor."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: float | None = Field(None, ge=0)
    """GPUs per worker; None: 1 where the Ray cluster has GPUs, else 0 (CPU threads)."""
    num_cpus: float = Field(1, gt=0)
    """CPUs Ray reserves per worker."""
    num_threads: int = Field(1, ge=1)
    """torch threads inside the worker (CPU)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources, to pin a pool to a node type."""


class ServeConfig(BaseModel):
    """Everything `tandem serve` needs. Every field can come from YAML (--config)
    and most from flags; flags win."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    """Checkpoint directory or hub id; None: the embedded default model."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id; defaults to the model's."""
    load_format: Literal["auto", "dummy"] = "auto"
    """auto: read the checkpoint's safetensors; dummy: random weights of its config."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and KV cache dtype."""
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: separate prefill and decode pools; colocated: one pool does both."""
    prefill: int = Field(1, ge=0)
    """Prefill workers (disaggregated mode)."""
    decode: int = Field(1, ge=1)
    """Decode workers (or colocated workers)."""
    prefill_resources: WorkerResources = Field(default_factory=WorkerResources)
    """Resources of each prefill worker."""
    decode_resources: WorkerResources = Field(default_factory=WorkerResources)
    """Resources of each decode (or colocated) worker."""
    host: str = "127.0.0.1"
    """Address the router's gRPC API binds to."""
    port: int = Field(50051, ge=0, le=65535)
    """Router port; 0 picks a free one."""
    ray_address: str | None = None
    """Join this Ray cluster; None starts a local one (on loopback when host is loopback)."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block."""
    kv_cache_memory_mb: int = Field(512, ge=1)
    """KV pool size of each worker."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Token budget of one engine step; longer prompts are prefilled in chunks."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences one worker runs at once."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt plus output; None: the model's limit, capped by the KV pool."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of earlier requests with the same prefix."""
    max_queued_requests: int = Field(1024, ge=1)
    """Requests in flight beyond this get RESOURCE_EXHAUSTED at once."""
    routing_policy: Literal["round_robin", "least_loaded"] = "least_loaded"
    """How the router picks a worker in each pool."""
    redis_url: str | None = None
    """Block index in Redis (e.g. redis://127.0.0.1:6379/0), shared by several routers;
    None: an in-process index in the router."""
    deployment: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Name of this deployment: its Redis keys are prefixed with it (and the model)."""
    prefix_routing: bool = True
    """Route requests to workers that hold their prefix (KV-aware routing)."""
    load_weight_blocks: float = Field(4.0, ge=0)
    """KV-aware routing: one request in flight on a worker costs as much as this many
    cached prefix blocks are worth."""
    local_prefill_tokens: int = Field(256, ge=0)
    """When a decode worker holds a request's prefix and at most this many prompt tokens
    are left to compute, it prefills them itself (no transfer); 0 turns this off."""
    pull_min_blocks: int = Field(2, ge=0)
    """A prefill worker pulls prefix blocks (PullBlocks) from the worker holding most of
    the prompt when it lacks at least this many of them; 0 turns pulls off."""
    grace_period_s: float = Field(30.0, ge=0)
    """On SIGTERM, time given to requests in flight before the pools stop."""
    kv_lease_s: float = Field(30.0, gt=0)
    """Blocks reserved or pinned for a KV transfer are freed after this."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Upper bound on one request when the client sets no deadline."""
    kv_transfer_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one KV push or pull; a stalled transfer fails after it, its blocks
    are freed on both sides and the request is retried."""
    max_attempts: int = Field(4, ge=1)
    """Tries per request: the first one plus retries after a worker died or a transfer
    failed (a decode failover resumes from the tokens already streamed)."""
    retry_backoff_s: float = Field(0.1, ge=0)
    """Wait before the first retry; it doubles with each further one."""
    retry_backoff_max_s: float = Field(2.0, ge=0)
    """Longest wait between two tries of a request."""
    worker_max_restarts: int = Field(3, ge=-1)
    """Ray restarts a dead worker actor this many times (-1: always, 0: never); the
    router routes to it again once its health check passes."""
    worker_recovery_timeout_s: float = Field(120.0, gt=0)
    """How long the router waits for a dead worker to come back before it forgets it."""
    stall_check_s: float = Field(5.0, gt=0)
    """A request whose worker has been silent this long asks the worker's health."""
    health_timeout_s: float = Field(10.0, gt=0)
    """A worker whose engine does not answer a health check in this long counts as dead."""

    @model_validator(mode="after")
    def _check_pools(self) -> ServeConfig:
        if self.mode == "disaggregated" and self.prefill < 1:
            raise ValueError("prefill must be >= 1 in disaggregated mode")
        return self

    @classmethod
    def load(cls, path: str | Path | None, **overrides: object) -> ServeConfig:
        """YAML file (optional) plus overrides (None values are ignored)."""
        data: dict = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping at the top level")
            data.update(loaded)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
