"""Deployment configuration: flags or a YAML file, validated."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

if TYPE_CHECKING:
    from kv_transfer import TransferConfig
    from net.security import ClusterSecurity

CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"


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
    labels: dict[str, str] = Field(default_factory=dict)
    """Ray node labels the worker's node must carry (``ray start --labels``), another
    way to pin a pool to a node type."""


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
    cuda_graphs: bool = False
    """GPU workers replay decode steps as CUDA graphs captured at fixed batch sizes."""
    cpu_kernels: Literal["auto", "on", "off"] = "auto"
    """Fused C++ kernels for float32 CPU workers: auto (fall back to PyTorch if they
    cannot be built), on (a failed build is an error), off."""
    greedy_screen: bool = True
    """With the CPU kernels: an int8 (hidden size up to 512) or float16 copy of the LM
    head screens plain-greedy steps (same tokens, less work); false saves its memory
    (1 or 2 bytes per head weight)."""
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
    max_num_batched_tokens: int = Field(512, ge=1)
    """Token budget of one engine step; longer prompts are prefilled in chunks. Small
    chunks let a prefill worker hand prompts to decode as they finish rather than a
    batch at a time (lower time to first token; on CPU 512 rows already keep the
    matmuls at full speed); GPU deployments use a few thousand."""
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
    http_port: int | None = Field(None, ge=0, le=65535)
    """Port of the OpenAI-compatible HTTP API and /metrics; None: no HTTP front; 0 picks a
    free one."""
    http_host: str | None = None
    """Address the HTTP front binds to; None: the same as host."""
    served_model_name: str | None = None
    """Model name that /v1/models lists and HTTP requests must give; None: the model
    argument (or tandem-tiny-llama for the embedded model)."""
    chat_template: str | None = None
    """Jinja chat template file for /v1/chat/completions; None: the tokenizer's, else a
    plain "role: content" fallback."""
    api_keys: list[SecretStr] = Field(default_factory=list)
    """Keys accepted as 'authorization: Bearer <key>' on the gRPC and HTTP APIs (with
    api_keys_file and $TANDEM_API_KEYS); none anywhere: no authentication."""
    api_keys_file: str | None = None
    """File of accepted API keys, one per line (# starts a comment)."""
    log_format: Literal["text", "json"] = "text"
    """Router and worker logs: text (request events as key=value) or JSON lines."""
    batch_scheduling: bool = True
    """Linux: the router process (and a local Ray it starts) and the prefill workers run
    under SCHED_BATCH, decode workers under the normal policy, so that on shared cores
    the router woken by a decode worker's output never preempts its engine thread."""
    worker_niceness: int | None = Field(0, ge=-20, le=19)
    """Nice value of every worker process (all its threads); None keeps Ray's, 15.
    Lowering it needs privilege (root, CAP_SYS_NICE or RLIMIT_NICE) on a cluster
    joined with ray_address; a local cluster starts its workers with it."""
    cpu_binding: bool = True
    """Where `tandem serve` starts the local Ray cluster for CPU workers: each decode
    (or colocated) worker's process runs on num_threads cores of its own (the
    highest-numbered) and the router, Ray's daemons and the prefill workers on the
    cores left over, so that nothing woken by a step's output runs on a decode core.
    Nothing is bound when that would leave no core over, on a Ray cluster joined with
    ray_address, with GPU workers, or when false."""
    speculative_method: Literal["none", "ngram", "draft"] = "none"
    """Speculative decoding in the decode (or colocated) pool: ngram proposes by prompt
    lookup, draft by a smaller model sharing the tokenizer (draft_model); none: off."""
    num_speculative_tokens: int = Field(4, ge=1)
    """Tokens proposed per sequence and step; the target verifies them in one pass."""
    speculative_ngram_min: int = Field(1, ge=1)
    """Prompt lookup: shortest n-gram matched."""
    speculative_ngram_max: int = Field(4, ge=1)
    """Prompt lookup: longest n-gram matched (tried first)."""
    draft_model: str | None = None
    """Checkpoint directory or hub id of the draft model (speculative_method draft),
    loaded with the target's load_format and dtype."""
    kv_transfer_dtype: Literal["auto", "int8", "fp8"] = "auto"
    """Encoding of KV blocks sent between workers: auto: the cache's dtype; int8 or fp8
    (e4m3): one byte per value plus a float32 scale per block, layer, K/V and kv head."""
    max_message_mb: int = Field(64, ge=1)
    """Largest message (MiB) the router's API and Admin service accept or send; a
    bigger request gets RESOURCE_EXHAUSTED."""
    kv_max_message_mb: int = Field(64, ge=16)
    """Largest message (MiB) of the internal endpoints (KV transfer, worker output
    streams) and largest KV data-channel frame."""
    local_output_streams: bool = True
    """A decode worker's output stream to a router on the same machine goes over a
    Unix socket (no TLS: it never leaves the machine) instead of TCP."""
    tls_cert: Path | None = None
    """PEM certificate chain of the router's gRPC API; set with tls_key to serve TLS only."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    cluster_tls_cert: Path | None = None
    """PEM certificate every worker and the router present on the internal endpoints
    (KV transfer gRPC and data channel, output streams); set with cluster_tls_key."""
    cluster_tls_key: Path | None = None
    """PEM private key of cluster_tls_cert."""
    cluster_tls_ca: Path | None = None
    """CA that signs cluster certificates: internal servers then demand a client
    certificate (mutual TLS) and clients check servers' against it."""
    cluster_tls_server_name: str | None = None
    """Name internal clients expect in servers' certificates; None: the peer's address
    (then the certificate must name every node's IP)."""
    cluster_secret: SecretStr | None = Field(None, repr=False)
    """Shared secret internal KV and output-stream calls must present (else
    UNAUTHENTICATED); YAML or the TANDEM_CLUSTER_SECRET environment variable, never a
    flag; never logged."""
    worker_check_interval_s: float = Field(0.0, ge=0)
    """Every this many seconds the router looks for workers whose actor died (their node
    went away) and starts replacements where Ray finds the pool's resources; 0: off."""
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
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method draft needs draft_model")
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError("speculative_ngram_min must be <= speculative_ngram_max")
        return self

    @model_validator(mode="after")
    def _check_tls(self) -> ServeConfig:
        for cert, key in (("tls_cert", "tls_key"), ("cluster_tls_cert", "cluster_tls_key")):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"{cert} and {key} go together: set both or neither")
        if self.cluster_tls_ca is not None and self.cluster_tls_cert is None:
            raise ValueError("cluster_tls_ca needs cluster_tls_cert and cluster_tls_key")
        files = ("tls_cert", "tls_key", "cluster_tls_cert", "cluster_tls_key", "cluster_tls_ca")
        for name in files:
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: no file at {path}")
        if self.cluster_secret is not None and not self.cluster_secret.get_secret_value():
            raise ValueError("cluster_secret must not be empty")
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
        if "cluster_secret" not in data and os.environ.get(CLUSTER_SECRET_ENV):
            data["cluster_secret"] = os.environ[CLUSTER_SECRET_ENV]
        return cls.model_validate(data)

    def served_name(self) -> str:
        """The served model name (/v1/models, GetModelInfo): served_model_name, else the
        model argument, else the embedded model's name."""
        from engine.config import DEFAULT_MODEL_NAME

        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    def cluster_security(self) -> ClusterSecurity:
        """The internal endpoints' secret and TLS, for workers and the router."""
        from net.security import ClusterSecurity, TLSFiles

        secret = self.cluster_secret.get_secret_value().encode() if self.cluster_secret else b""
        tls = None
        if self.cluster_tls_cert is not None and self.cluster_tls_key is not None:
            tls = TLSFiles(
                str(self.cluster_tls_cert),
                str(self.cluster_tls_key),
                str(self.cluster_tls_ca) if self.cluster_tls_ca else None,
                self.cluster_tls_server_name,
            )
        return ClusterSecurity(secret, tls)

    def transfer_config(self) -> TransferConfig:
        """What every worker's KV server and client use."""
        from kv_transfer import TransferConfig

        return TransferConfig(
            lease_s=self.kv_lease_s,
            timeout_s=self.kv_transfer_timeout_s,
            max_message_bytes=self.kv_max_message_mb << 20,
            security=self.cluster_security(),
            local_streams=self.local_output_streams,
        )
