"""Deployment configuration: a YAML file by sections, plus flags, validated.

``ServeConfig`` has one field per section (``engine``, ``pools``,
``server``, ``limits``, ``routing``, ``transfer``, ``speculative``,
``security``, ``tuning``); YAML nests keys under them (``pools: {prefill:
2}``) and Python passes dicts or section objects
(``ServeConfig(pools={"prefill": 2})``). Every check of a setting lives on
its section, or on ``ServeConfig`` when it spans sections; the sections
build what the workers run with (``EngineConfig``, ``TransferConfig``,
``ClusterSecurity``), so no other module copies fields one by one.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from protocol.sampling import MAX_STOP_STRINGS, MAX_STOP_TOTAL_CHARS
from router.limits import RequestLimits

if TYPE_CHECKING:
    from engine.config import EngineConfig, SpeculativeConfig
    from kv_transfer import TransferConfig
    from net.security import ClusterSecurity

CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"
REDIS_PASSWORD_ENV = "TANDEM_REDIS_PASSWORD"


class Section(BaseModel):
    """A section of the serve config: unknown keys are errors, and a key that
    belongs to another section (or to the flat layout of old) says where it
    goes."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _misplaced_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = _moved_keys(data, cls.model_fields)
            if moved:
                raise _moved_error(f"not keys of this section: {moved}")
        return data


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
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks of each worker (tensor parallelism, docs/tensor-parallel.md): its model
    is split over this many processes on one node, each with num_gpus, num_cpus and
    num_threads of its own, placed together by a Ray placement group."""


class EngineSection(Section):
    """The model and the engine every worker runs it with. Every field but
    kv_cache_memory_mb and kv_tier_mb is an ``EngineConfig`` field of the same name."""

    model: str | None = None
    """Checkpoint directory or hub id; None: the embedded default model."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id, when it is not in the model's directory."""
    load_format: Literal["auto", "dummy"] = "auto"
    """auto: read the checkpoint's safetensors; dummy: random weights of its config, to
    benchmark a model without downloading its weights."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and KV cache dtype; GPU deployments use bfloat16 or float16 (half the
    memory, faster)."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block, the unit of prefix caching, routing and KV transfer."""
    kv_cache_memory_mb: int = Field(512, ge=1)
    """KV pool size (MiB) of each worker: more holds more sequences and cached
    prefixes at once; size it to the memory the weights leave free."""
    max_num_batched_tokens: int = Field(512, ge=1)
    """Token budget of one engine step; longer prompts are prefilled in chunks. Small
    chunks let a prefill worker hand prompts to decode as they finish rather than a
    batch at a time (lower time to first token); GPUs need a few thousand to keep busy."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences one worker runs at once; lower it to bound the decode batch (and
    so the time per output token) under load."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt plus output; None: the model's limit, capped by the KV pool. Lower
    it to refuse requests that would hold too much of the pool."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of earlier requests with the same prefix; false keeps no
    finished request's blocks (and turns KV-aware routing off)."""
    cpu_kernels: Literal["auto", "on", "off"] = "auto"
    """Fused C++ kernels for float32 CPU workers: auto (fall back to PyTorch if they
    cannot be built), on (a failed build is an error), off."""
    greedy_screen: bool = True
    """With the CPU kernels: an int8 (hidden size up to 512) or float16 copy of the LM
    head screens plain-greedy steps (same tokens, less work); false saves its memory
    (1 or 2 bytes per head weight)."""
    matrix_units: bool = True
    """Quantized CPU workers on a CPU with AMX-BF16: matmuls of 128 rows or more
    (prefills, large batches) run in bfloat16 on the matrix tiles, each matrix
    dequantized for the call; false keeps them on the integer kernels."""
    quantization: Literal["auto", "none", "int8", "q4", "as_stored"] = "auto"
    """Weights of the linear layers and the LM head: auto (int8 for the packaged
    SmolLM2-135M-Instruct, none for other models), none (the checkpoint's floats),
    int8 (per output channel, quantized at load), q4 (4-bit blocks of 32, GGUF's
    Q4_1, quantized at load) or as_stored (a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors
    as stored; none for other checkpoints). Fewer bytes a weight: faster CPU decode,
    slightly different outputs; every worker of a deployment must use one value."""
    cuda_graphs: bool = False
    """GPU workers replay decode steps as CUDA graphs captured at fixed batch sizes:
    less CPU overhead per step, at the cost of capture time and one KV block."""
    attention: Literal["auto", "triton", "sdpa"] = "auto"
    """How GPU workers attend over the paged KV cache: auto (triton where Triton is
    installed, except in deterministic mode), triton (one kernel that reads the cache
    blocks in place: docs/gpu.md) or sdpa (each sequence's blocks gathered, then
    PyTorch's scaled_dot_product_attention). CPU workers use their fused kernels."""
    simulate: str | None = None
    """A profile file or a shipped profile's name (`tandem plan --profiles`): the workers
    run the simulated model (docs/simulated-engine.md), which sleeps the profile's step
    time and gives deterministic tokens; model is then not loaded, and
    kv_cache_memory_mb counts the profiled model's KV bytes per token."""
    kv_tier_mb: int = Field(0, ge=0)
    """Second KV tier (MiB) of each worker: cached blocks evicted from the KV pool move
    there (pinned host memory behind a GPU, a memory-mapped file behind a CPU) and a
    later prefix hit copies them back instead of computing them; 0: none."""
    kv_tier_dir: str | None = None
    """Directory of a CPU worker's tier file (created 0600, unlinked once mapped, so
    nothing is left after a stop); None: $XDG_STATE_HOME/tandem/kv-tier."""
    deterministic: bool = False
    """Greedy and seeded outputs (tokens and logprobs) bit-identical whatever else is
    in the batch, after a prefix hit, a handoff from prefill to decode and a failover
    (docs/deterministic.md); slower. Needs transfer dtype auto, no speculative
    decoding and no CUDA graphs."""

    def engine_config(self, **worker: Any) -> EngineConfig:
        """The ``EngineConfig`` of one worker: this section plus what differs per
        worker or comes from other sections (device, num_threads, speculative,
        kv_transfer_dtype)."""
        from engine.config import EngineConfig

        fields = self.model_dump(exclude={"kv_cache_memory_mb", "kv_tier_mb"})
        return EngineConfig(
            **fields,
            kv_cache_memory_bytes=self.kv_cache_memory_mb << 20,
            kv_tier_memory_bytes=self.kv_tier_mb << 20,
            **worker,
        )


def pool_size_error(name: str, size: int, max_workers: int) -> str | None:
    """Why a pool of ``size`` workers is refused (the config's sizes and Admin.Scale's),
    naming ``name``; None: it is not."""
    if size > max_workers:
        return f"{name}: {size} workers is above pools.max_workers ({max_workers})"
    return None


class PoolsSection(Section):
    """The worker pools: how many, where they run, and how they are kept up."""

    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: separate prefill and decode pools; colocated: one pool does both
    (fewer workers, no KV transfer, but prefills share steps with decodes)."""
    prefill: int = Field(1, ge=0)
    """Prefill workers: at least 1 in disaggregated mode; 0 (or unset) in colocated mode."""
    decode: int = Field(1, ge=1)
    """Decode workers (or colocated workers)."""
    prefill_resources: WorkerResources = Field(default_factory=WorkerResources)
    """Resources of each prefill worker."""
    decode_resources: WorkerResources = Field(default_factory=WorkerResources)
    """Resources of each decode (or colocated) worker."""
    ray_address: str | None = None
    """Join this Ray cluster (auto: the cluster of this node) to run the pools on several
    machines; None starts a local one (on loopback when server.host is loopback)."""
    cpu_binding: bool = True
    """Where `tandem serve` starts the local Ray cluster for CPU workers: each decode
    (or colocated) worker's process runs on num_threads cores of its own (the
    highest-numbered) and the router, Ray's daemons and the prefill workers on the
    cores left over, so that nothing woken by a step's output runs on a decode core.
    Nothing is bound when that would leave no core over, on a Ray cluster joined with
    ray_address, with GPU workers, or when false (to share the machine with other
    processes that need those cores)."""
    batch_scheduling: bool = True
    """Linux: the router process (and a local Ray it starts) and the prefill workers run
    under SCHED_BATCH, decode workers under the normal policy, so that on shared cores
    the router woken by a decode worker's output never preempts its engine thread."""
    worker_niceness: int | None = Field(0, ge=-20, le=19)
    """Nice value of every worker process (all its threads); None keeps Ray's, 15.
    Raise it to yield the cores to other work on the machine. Lowering it needs
    privilege (root, CAP_SYS_NICE or RLIMIT_NICE) on a cluster joined with
    ray_address; a local cluster starts its workers with it."""
    worker_max_restarts: int = Field(3, ge=-1)
    """Ray restarts a dead worker actor this many times (-1: always, 0: never); the
    router routes to it again once its health check passes."""
    worker_recovery_timeout_s: float = Field(120.0, gt=0)
    """How long the router waits for a dead worker to come back before it forgets it;
    raise it when a worker takes longer to restart (a big model to load)."""
    worker_check_interval_s: float = Field(5.0, ge=0)
    """Every this many seconds the router looks for workers whose actor died (their node
    went away, or it was killed) and has the deployment start replacements where Ray
    finds the pool's resources (within placement_timeout_s); 0: off (the pool shrinks
    by the workers lost)."""
    max_workers: int = Field(64, ge=1)
    """Most workers in each pool: a larger prefill or decode in the config, or asked of
    Admin.Scale (INVALID_ARGUMENT), is refused."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long Admin.Scale (and the replacement of dead workers) waits for new workers
    to be placed and started; past it, those not started are removed and Scale fails
    with DEADLINE_EXCEEDED. Raise it for a big model that takes long to load."""

    @model_validator(mode="before")
    @classmethod
    def _colocated_has_no_prefill(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode") == "colocated" and "prefill" not in data:
            return {**data, "prefill": 0}
        return data

    @model_validator(mode="after")
    def _check_sizes(self) -> PoolsSection:
        if self.mode == "disaggregated" and self.prefill < 1:
            raise ValueError("prefill must be >= 1 in disaggregated mode")
        if self.mode == "colocated" and self.prefill:
            raise ValueError("prefill must be 0 or unset in colocated mode")
        for name in ("prefill", "decode"):
            if (why := pool_size_error(name, getattr(self, name), self.max_workers)) is not None:
                raise ValueError(why)
        return self

    def resources_of(self, role: str) -> WorkerResources:
        """The resources of each worker of ``role`` (prefill, decode or colocated)."""
        return self.prefill_resources if role == "prefill" else self.decode_resources

    def resized(self, prefill: int | None, decode: int | None) -> PoolsSection:
        """These pools with new sizes (None: unchanged), checked as the config is;
        raises ValueError naming what is wrong."""
        sizes = {"prefill": prefill, "decode": decode}
        data = {**self.model_dump(), **{k: v for k, v in sizes.items() if v is not None}}
        try:
            return PoolsSection.model_validate(data)
        except ValidationError as e:
            lines = (line.removeprefix("(top level): ") for line in describe_errors(e))
            raise ValueError("; ".join(lines)) from None


class ServerSection(Section):
    """The router's APIs."""

    host: str = "127.0.0.1"
    """Address the router's gRPC API binds to (0.0.0.0: every interface)."""
    port: int = Field(50051, ge=0, le=65535)
    """Router gRPC port; 0 picks a free one."""
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
    log_format: Literal["text", "json"] = "text"
    """Router and worker logs: text (request events as key=value) or JSON lines (for a
    log collector)."""


class LimitsSection(Section):
    """What one router admits, and for how long."""

    max_queued_requests: int = Field(1024, ge=1)
    """Requests in flight beyond this get RESOURCE_EXHAUSTED (HTTP 429) at once, so that
    an overload is refused rather than queued past every deadline."""
    max_waiting_requests: int = Field(1024, ge=0)
    """Requests that may wait for KV room while no decode worker has it (in priority
    order, each within its deadline); past it RESOURCE_EXHAUSTED (HTTP 429) at once."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Upper bound on one request when the client sets no deadline."""
    max_message_mb: int = Field(64, ge=1)
    """Largest message (MiB) the router's API and Admin service accept or send; a
    bigger request gets RESOURCE_EXHAUSTED."""
    grace_period_s: float = Field(30.0, ge=0)
    """On SIGTERM, time given to requests in flight before the router stops (and,
    in an ephemeral deployment, its pools; a named deployment's keep serving)."""
    max_in_flight_per_key: int = Field(256, ge=1)
    """Requests one API key may have in flight; past it RESOURCE_EXHAUSTED (HTTP 429).
    Applies only when API keys are configured."""
    max_http_body_mb: int = Field(16, ge=1, le=1024)
    """Largest HTTP request body (MiB); a bigger one gets 413 before it is read."""
    max_stop_strings: int = Field(16, ge=0, le=MAX_STOP_STRINGS)
    """Most stop strings one request may give (INVALID_ARGUMENT / 400 past it)."""
    max_stop_bytes: int = Field(4096, ge=1, le=MAX_STOP_TOTAL_CHARS)
    """Most UTF-8 bytes one request's stop strings may hold in all."""
    max_unread_output_kb: int = Field(1024, ge=1, le=1 << 20)
    """Most output (KiB: token ids, text, logprobs) the router holds for one request
    whose client has not accepted it; past it the request is aborted and ends with
    RESOURCE_EXHAUSTED (HTTP: an SSE error event). A client that keeps reading never
    nears it: a slow one gets bigger chunks."""
    slow_client_timeout_s: float = Field(60.0, gt=0)
    """Longest one write to a client may wait for it to read; past it the request is
    aborted and ends with RESOURCE_EXHAUSTED (HTTP: the connection is closed)."""

    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_stop_strings=self.max_stop_strings,
            max_stop_bytes=self.max_stop_bytes,
            max_http_body_bytes=self.max_http_body_mb << 20,
            max_in_flight_per_key=self.max_in_flight_per_key,
            max_unread_output_bytes=self.max_unread_output_kb << 10,
            slow_client_timeout_s=self.slow_client_timeout_s,
        )


class RoutingSection(Section):
    """How the router picks workers, and where it keeps the block index."""

    policy: Literal["round_robin", "least_loaded"] = "least_loaded"
    """How the router picks a worker in each pool when no worker holds a request's
    prefix (or prefix routing is off)."""
    prefix_routing: bool = True
    """Route requests to workers that hold their prefix (KV-aware routing)."""
    local_prefill_tokens: int = Field(256, ge=0)
    """When a decode worker holds a request's prefix and at most this many prompt tokens
    are left to compute, it prefills them itself (no transfer); 0 turns this off, so
    that decode steps never carry prefill work."""
    redis_url: str | None = None
    """Block index in Redis (e.g. redis://127.0.0.1:6379/0; rediss:// for TLS), shared by
    several routers; None: an in-process index in the router."""
    redis_password: SecretStr | None = Field(None, repr=False)
    """Password the router and workers AUTH to Redis with (unless redis_url carries one);
    YAML or the TANDEM_REDIS_PASSWORD environment variable, never a flag; never logged."""
    index_reconcile_interval_s: float = Field(60.0, ge=0)
    """Seconds between two checks of the block index against the blocks each worker
    holds, which remove the stale entries (docs/prefix-caching.md); 0: only on demand
    (Admin.ReconcileIndex)."""

    def redis_password_value(self) -> str | None:
        return self.redis_password.get_secret_value() if self.redis_password else None


DEPLOYMENT_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class DeploymentSection(Section):
    """Who owns the pools: this router alone, or a named deployment that several
    routers share and that outlives each of them (docs/deployments.md)."""

    name: str | None = Field(None, pattern=DEPLOYMENT_NAME_PATTERN)
    """Name of the deployment: its workers are detached Ray actors that outlive this
    router, shared by every router started with the name (a router with a new name
    starts them, one with a running name attaches); also the prefix of its Redis keys.
    None: an ephemeral deployment whose workers stop with this router (Redis prefix
    "default")."""
    attach: bool = False
    """Only attach to the running pools of deployment.name: start fails, naming the
    deployment, when none runs, rather than starting new pools."""

    @model_validator(mode="after")
    def _attach_needs_name(self) -> DeploymentSection:
        if self.attach and self.name is None:
            raise ValueError("attach needs a deployment name (deployment.name)")
        return self

    @property
    def named(self) -> bool:
        return self.name is not None

    def redis_name(self) -> str:
        """The prefix of the deployment's Redis keys: its name, "default" when unnamed."""
        return self.name or "default"


class TransferSection(Section):
    """KV transfer between workers and the workers' output streams."""

    dtype: Literal["auto", "int8", "fp8"] = "auto"
    """Encoding of KV blocks sent between workers: auto: the cache's dtype; int8 or fp8
    (e4m3): one byte per value plus a float32 scale per block, layer, K/V and kv head,
    for networks where transfers are the bottleneck."""
    lease_s: float = Field(30.0, gt=0)
    """Blocks reserved or pinned for a KV transfer are freed after this long without
    progress."""
    timeout_s: float = Field(30.0, gt=0)
    """Deadline of one KV pull, and the longest a KV push may go without progress (a
    streamed push lasts as long as its prefill); a stalled transfer fails after it,
    its blocks are freed on both sides and the request is retried. Raise it on slow
    networks with long prompts."""
    stream: bool = True
    """Push a prompt's KV to the decode worker while the prefill computes it, layer by
    layer, so TTFT no longer includes the whole transfer; the decode worker then holds
    the request's blocks from the prefill's first step on. false: push after the
    prefill (the blocks are held only while they move)."""
    max_message_mb: int = Field(64, ge=16)
    """Largest message (MiB) of the internal endpoints (KV transfer, worker output
    streams) and largest KV data-channel frame; at least 16 (a chunk is 8 MiB)."""
    local_output_streams: bool = True
    """A decode worker's output stream to a router on the same machine goes over a Unix
    socket (same user only; off under cluster mutual TLS) instead of TCP; false: TCP
    (and TLS where configured) everywhere."""
    port_range: tuple[int, int] | None = None
    """[low, high]: the ports every worker's internal listeners (KV gRPC, KV data channel,
    output streams) bind, each the first free one, so that firewalls can name them; give
    at least 3 ports per worker of a node. None: ports the kernel picks."""

    @model_validator(mode="after")
    def _check_ports(self) -> TransferSection:
        if self.port_range is not None:
            low, high = self.port_range
            if not 1024 <= low <= high <= 65535:
                raise ValueError(
                    f"port_range: expected [low, high] in 1024-65535, got {low}-{high}"
                )
        return self

    def transfer_config(self, security: ClusterSecurity) -> TransferConfig:
        """What every worker's KV server and client use."""
        from kv_transfer import TransferConfig

        return TransferConfig(
            lease_s=self.lease_s,
            timeout_s=self.timeout_s,
            stream_push=self.stream,
            max_message_bytes=self.max_message_mb << 20,
            security=security,
            local_streams=self.local_output_streams,
            port_range=self.port_range,
        )


class SpeculativeSection(Section):
    """Speculative decoding in the decode (or colocated) pool. The fields are those
    of ``engine.config.SpeculativeConfig``, which checks them."""

    method: Literal["none", "ngram", "draft"] = "none"
    """ngram proposes by prompt lookup (for outputs that repeat their input: code edits,
    extraction), draft by a smaller model sharing the tokenizer (draft_model); none: off."""
    num_speculative_tokens: int = Field(4, ge=1)
    """Tokens proposed per sequence and step; the target verifies them in one pass."""
    ngram_min: int = Field(1, ge=1)
    """Prompt lookup: shortest n-gram matched."""
    ngram_max: int = Field(4, ge=1)
    """Prompt lookup: longest n-gram matched (tried first)."""
    draft_model: str | None = None
    """Checkpoint directory or hub id of the draft model (method draft), loaded with the
    target's load_format and dtype."""

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSection:
        self.speculative_config()  # the engine's checks (a ValueError names the field)
        return self

    def speculative_config(self) -> SpeculativeConfig | None:
        """The engine's speculative options; None when off."""
        if self.method == "none":
            return None
        from engine.config import SpeculativeConfig

        return SpeculativeConfig(**self.model_dump())


class SecuritySection(Section):
    """API keys, TLS, and the cluster's own secret and TLS (docs/security.md)."""

    api_keys: list[SecretStr] = Field(default_factory=list)
    """Keys accepted as 'authorization: Bearer <key>' on the gRPC and HTTP APIs (with
    api_keys_file and $TANDEM_API_KEYS); none anywhere: no authentication."""
    api_keys_file: str | None = None
    """File of accepted API keys, one per line (# starts a comment): keys kept out of
    the config file. Only its owner may read it (mode 0600): start fails otherwise."""
    admin_keys: list[SecretStr] = Field(default_factory=list)
    """Keys the Admin service (Scale, Status) accepts, with admin_keys_file and
    $TANDEM_ADMIN_KEYS; none anywhere: every control call is refused. No key may be
    an API key too."""
    admin_keys_file: str | None = None
    """File of admin keys, one per line (# starts a comment); mode 0600, as
    api_keys_file."""
    cache_domain: Literal["shared", "per_api_key"] = "shared"
    """Prefix-cache domains: shared: requests share cached blocks unless their
    cache_salt differs; per_api_key: each API key is a domain of its own (needs API
    keys), so no key's requests hit (or time) another key's cached prompts."""
    tls_cert: Path | None = None
    """PEM certificate chain of the router's gRPC API (and of the HTTP front unless
    http_tls_cert is set); set with tls_key to serve TLS only."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    http_tls_cert: Path | None = None
    """PEM certificate chain of the HTTP front (HTTPS only, plain HTTP refused); set with
    http_tls_key. Unset: tls_cert and tls_key, when set, serve the HTTP front too."""
    http_tls_key: Path | None = None
    """PEM private key of http_tls_cert."""
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
    """Shared secret every internal endpoint (KV gRPC and data channel, output streams)
    makes its peers prove (else UNAUTHENTICATED); YAML or the TANDEM_CLUSTER_SECRET
    environment variable, never a flag; never logged. Unset: the router generates a
    random one at start and hands it to its workers (routers sharing workers or a Redis
    index must then be given one)."""

    _generated_secret: bytes = PrivateAttr(default_factory=lambda: secrets.token_bytes(32))

    @model_validator(mode="after")
    def _check_tls(self) -> SecuritySection:
        pairs = (
            ("tls_cert", "tls_key"),
            ("http_tls_cert", "http_tls_key"),
            ("cluster_tls_cert", "cluster_tls_key"),
        )
        for cert, key in pairs:
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"{cert} and {key} go together: set both or neither")
        if self.cluster_tls_ca is not None and self.cluster_tls_cert is None:
            raise ValueError("cluster_tls_ca needs cluster_tls_cert and cluster_tls_key")
        files = (
            "tls_cert",
            "tls_key",
            "http_tls_cert",
            "http_tls_key",
            "cluster_tls_cert",
            "cluster_tls_key",
            "cluster_tls_ca",
        )
        for name in files:
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: no file at {path}")
        if self.cluster_secret is not None and not self.cluster_secret.get_secret_value():
            raise ValueError("cluster_secret must not be empty")
        return self

    def http_tls(self) -> tuple[Path, Path] | None:
        """(certificate, key) of the HTTP front: its own, else the gRPC API's; None:
        plain HTTP."""
        if self.http_tls_cert is not None and self.http_tls_key is not None:
            return self.http_tls_cert, self.http_tls_key
        if self.tls_cert is not None and self.tls_key is not None:
            return self.tls_cert, self.tls_key
        return None

    def adopt_secret(self, secret: bytes) -> None:
        """Use the secret of the deployment this router attaches to. A configured
        cluster_secret must be that one: a ValueError says so otherwise."""
        import hmac

        if self.cluster_secret is not None:
            if not hmac.compare_digest(self.cluster_secret.get_secret_value().encode(), secret):
                raise ValueError(
                    "security.cluster_secret differs from the secret of the deployment this "
                    "router attaches to: unset it (the router then takes the deployment's) or "
                    "give the one the deployment was started with"
                )
            return
        self._generated_secret = secret

    def cluster_security(self) -> ClusterSecurity:
        """The internal endpoints' secret and TLS, for workers and the router."""
        from net.security import ClusterSecurity, TLSFiles

        if self.cluster_secret is not None:
            secret = self.cluster_secret.get_secret_value().encode()
        else:
            secret = self._generated_secret
        tls = None
        if self.cluster_tls_cert is not None and self.cluster_tls_key is not None:
            tls = TLSFiles(
                str(self.cluster_tls_cert),
                str(self.cluster_tls_key),
                str(self.cluster_tls_ca) if self.cluster_tls_ca else None,
                self.cluster_tls_server_name,
            )
        return ClusterSecurity(secret, tls)


class TuningSection(Section):
    """Knobs the defaults suit almost every deployment for; change them only to
    answer a problem seen in production."""

    max_attempts: int = Field(4, ge=1)
    """Tries per request: the first one plus retries after a worker died or a transfer
    failed (a decode failover resumes from the tokens already streamed); 1: a failure
    reaches the client at once."""
    stall_check_s: float = Field(5.0, gt=0)
    """A request whose worker has been silent this long asks the worker's health; lower
    it to notice a hung worker sooner."""
    health_timeout_s: float = Field(10.0, gt=0)
    """A worker whose engine does not answer a health check in this long counts as dead;
    raise it when one engine step can take longer (a big model on CPU, a large
    max_num_batched_tokens)."""
    load_weight_blocks: float = Field(4.0, ge=0)
    """KV-aware routing: one request in flight on a worker costs as much as this many
    cached prefix blocks are worth; higher spreads load, lower follows prefixes."""
    pull_min_blocks: int = Field(2, ge=0)
    """A prefill worker pulls prefix blocks (PullBlocks) from the worker holding most of
    the prompt when it lacks at least this many of them, rather than computing them;
    0 turns pulls off."""
    host_block_weight: float = Field(0.75, ge=0, le=1)
    """KV-aware routing: what a prefix block held only in a worker's second KV tier
    (engine.kv_tier_mb) is worth against one in its KV pool (1); it is copied back
    before the request starts, which costs a fraction of computing it."""


class AutoscaleSection(Section):
    """Pool sizes chosen from the load and the latency targets (docs/autoscaling.md)."""

    enabled: bool = False
    """Resize the pools to meet ttft_ms and tpot_ms (`tandem serve --autoscale`); pools
    start at pools.prefill and pools.decode, kept within the bounds below."""
    ttft_ms: float = Field(1000.0, gt=0)
    """Time-to-first-token target in ms, queueing included (`--slo ttft_ms=T`)."""
    tpot_ms: float = Field(100.0, gt=0)
    """Time-per-output-token target in ms (`--slo tpot_ms=P`)."""
    target_attainment: float = Field(0.95, gt=0, lt=1)
    """Share of requests that should meet both targets: the quantile the model predicts."""
    profile: str | None = None
    """Step times the planner's model uses: a profile file (`tandem plan --profile-out`)
    or the name of a shipped profile; none: the engine's simulated profile."""
    min_prefill: int = Field(1, ge=1)
    """Fewest prefill workers the autoscaler keeps."""
    max_prefill: int = Field(8, ge=1)
    """Most prefill workers the autoscaler starts (at most pools.max_workers)."""
    min_decode: int = Field(1, ge=1)
    """Fewest decode workers the autoscaler keeps."""
    max_decode: int = Field(8, ge=1)
    """Most decode workers the autoscaler starts (at most pools.max_workers)."""
    interval_s: float = Field(2.0, gt=0)
    """Seconds between two decisions."""
    window_s: float = Field(20.0, gt=0)
    """Seconds of finished requests the load and the measured latencies are taken over;
    the arrival rate is the higher of this window's and its last quarter's."""
    headroom: float = Field(0.85, gt=0, le=1)
    """A size is chosen when its predicted latency is at most this share of the target."""
    scale_down_delay_s: float = Field(20.0, ge=0)
    """A pool shrinks only after a smaller size has sufficed for this long."""
    leader_lease_s: float = Field(10.0, gt=0)
    """With several routers, the one deciding keeps the turn while it reports within this
    many seconds; past it another router takes over."""

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscaleSection:
        for pool in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if lo > hi:
                raise ValueError(f"min_{pool} ({lo}) is above max_{pool} ({hi})")
        return self

    def bounds(self, pool: str) -> tuple[int, int]:
        """(fewest, most) workers of ``pool`` (prefill, or decode for decode and colocated)."""
        key = "prefill" if pool == "prefill" else "decode"
        return getattr(self, f"min_{key}"), getattr(self, f"max_{key}")


class ServeConfig(BaseModel):
    """Everything `tandem serve` needs, by section. Every field can come from YAML
    (--config) and some from flags (tandem_cli/serve.py, SERVE_FLAGS); flags win."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineSection = Field(default_factory=EngineSection)
    """The model and the engine options of every worker."""
    pools: PoolsSection = Field(default_factory=PoolsSection)
    """The worker pools: sizes, resources, placement and recovery."""
    server: ServerSection = Field(default_factory=ServerSection)
    """The router's gRPC and HTTP APIs and logs."""
    limits: LimitsSection = Field(default_factory=LimitsSection)
    """Admission, deadlines, message sizes and the shutdown grace period."""
    routing: RoutingSection = Field(default_factory=RoutingSection)
    """Worker choice, KV-aware routing and the block index."""
    deployment: DeploymentSection = Field(default_factory=DeploymentSection)
    """The deployment's name (named: detached pools shared by several routers) and
    whether this router only attaches to them."""
    transfer: TransferSection = Field(default_factory=TransferSection)
    """KV transfer between workers and the workers' output streams."""
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    """Speculative decoding in the decode (or colocated) pool."""
    security: SecuritySection = Field(default_factory=SecuritySection)
    """API keys, TLS and the cluster secret."""
    tuning: TuningSection = Field(default_factory=TuningSection)
    """Failover and routing knobs that rarely need changing."""
    autoscale: AutoscaleSection = Field(default_factory=AutoscaleSection)
    """Pool sizes that follow the load to meet latency targets."""

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any) -> Any:
        """A key of the flat layout of old says which section it moved to."""
        if isinstance(data, dict):
            moved = _moved_keys(data, cls.model_fields)
            if moved:
                raise _moved_error(
                    f"the configuration is nested by section (YAML: `pools: {{prefill: 2}}`, "
                    f"see docs/configuration.md): {moved}"
                )
        return data

    @classmethod
    def load(
        cls, path: str | Path | None, overrides: Mapping[str, object] | None = None
    ) -> ServeConfig:
        """YAML file (optional) plus ``overrides`` by dotted path
        (``{"pools.prefill": 2}``; None values are ignored), plus the cluster
        secret from $TANDEM_CLUSTER_SECRET and the Redis password from
        $TANDEM_REDIS_PASSWORD when neither sets them."""
        data: dict = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping at the top level")
            data = loaded
        for dotted, value in (overrides or {}).items():
            if value is not None:
                _set_path(data, dotted, value)
        for env, dotted in (
            (CLUSTER_SECRET_ENV, "security.cluster_secret"),
            (REDIS_PASSWORD_ENV, "routing.redis_password"),
        ):
            value = os.environ.get(env)
            section, key = dotted.split(".")
            given = data.get(section) or {}
            if value and isinstance(given, dict) and key not in given:
                _set_path(data, dotted, value)
        return cls.model_validate(data)

    def updated(self, **sections: Mapping[str, Any] | BaseModel) -> ServeConfig:
        """A copy with some fields of some sections replaced, validated again:
        ``config.updated(pools={"prefill": 2}, limits={"grace_period_s": 5})``."""
        data = self.model_dump(exclude_unset=True)
        for name, fields in sections.items():
            if isinstance(fields, BaseModel):
                fields = fields.model_dump(exclude_unset=True)
            data[name] = {**data.get(name, {}), **fields}
        return type(self).model_validate(data)

    def served_name(self) -> str:
        """The served model name (/v1/models, GetModelInfo): served_model_name, else the
        model argument, else the default model's name (engine/packaged_model.py)."""
        from engine.packaged_model import default_model_name

        if self.server.served_model_name or self.engine.model:
            return self.server.served_model_name or self.engine.model or ""
        if self.engine.simulate is not None:
            return f"simulated-{Path(self.engine.simulate).name.removesuffix('.json')}"
        return default_model_name()

    def engine_config(self, role: str, num_gpus: float) -> EngineConfig:
        """The engine options of one worker of ``role`` with ``num_gpus`` GPUs; only
        decode (and colocated) workers speculate."""
        tp = self.pools.resources_of(role).tensor_parallel_size
        return self._engine_config(role, num_gpus, tensor_parallel_size=tp)

    def _engine_config(self, role: str, num_gpus: float, **options: Any) -> EngineConfig:
        return self.engine.engine_config(
            device="cuda" if num_gpus > 0 else "cpu",
            num_threads=self.pools.resources_of(role).num_threads,
            speculative=None if role == "prefill" else self.speculative.speculative_config(),
            kv_transfer_dtype=self.transfer.dtype,
            **options,
        )

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> ServeConfig:
        """A tensor-parallel pool refuses what its engine cannot run (engine.config says why)."""
        from engine.config import tensor_parallel_conflict

        roles = ["decode"] if self.pools.mode == "colocated" else ["prefill", "decode"]
        for role in roles:
            tp = self.pools.resources_of(role).tensor_parallel_size
            if tp > 1:
                why = tensor_parallel_conflict(self._engine_config(role, 0), tp)
                if why is not None:
                    raise ValueError(f"pools.{role}_resources: {why}")
        return self

    @model_validator(mode="after")
    def _check_deterministic(self) -> ServeConfig:
        """Deterministic mode refuses what would break it (engine.config says why)."""
        from engine.config import deterministic_conflict

        if self.engine.deterministic:
            why = deterministic_conflict(
                self.transfer.dtype, self.speculative.method != "none", self.engine.cuda_graphs,
                self.engine.attention,
            )  # fmt: skip
            gpus = {self.pools.prefill_resources.num_gpus, self.pools.decode_resources.num_gpus}
            if why is None and self.pools.mode == "disaggregated" and len(gpus) > 1:
                why = (
                    "deterministic: the prefill and decode pools must run on the same kind of "
                    "device (prefill_resources.num_gpus and decode_resources.num_gpus differ)"
                )
            if why is not None:
                raise ValueError(why)
        return self

    def transfer_config(self) -> TransferConfig:
        """What every worker's KV server and client (and the router's streams) use."""
        return self.transfer.transfer_config(self.security.cluster_security())


SECTIONS: dict[str, type[Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in ServeConfig.model_fields.items()
}

# Keys of the flat configuration of old whose name changed in their section,
# or that two sections have (dtype, max_message_mb); every other one kept its
# name in the one section that has it.
RENAMED_KEYS: dict[str, str] = {
    "dtype": "engine.dtype",
    "routing_policy": "routing.policy",
    "kv_transfer_dtype": "transfer.dtype",
    "kv_lease_s": "transfer.lease_s",
    "kv_transfer_timeout_s": "transfer.timeout_s",
    "kv_max_message_mb": "transfer.max_message_mb",
    "max_message_mb": "limits.max_message_mb",
    "speculative_method": "speculative.method",
    "speculative_ngram_min": "speculative.ngram_min",
    "speculative_ngram_max": "speculative.ngram_max",
}
# Keys of old that are no longer settings, and where their value lives now.
REMOVED_KEYS: dict[str, str] = {
    "retry_backoff_s": "router/failover.py, RETRY_BACKOFF_S",
    "retry_backoff_max_s": "router/failover.py, RETRY_BACKOFF_MAX_S",
}
# Keys of old sections that moved to a section of the same name.
MOVED_SECTION_KEYS: dict[str, str] = {
    "deployment": "deployment.name (a section of its own, also the Redis prefix)",
}


def _home(key: str) -> str | None:
    """Where ``key`` belongs: the new place of an old flat key, or the
    section(s) with a field of that name; None for an unknown key."""
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key]
    if key in REMOVED_KEYS:
        return f"no longer a setting ({REMOVED_KEYS[key]})"
    if key in MOVED_SECTION_KEYS:
        return MOVED_SECTION_KEYS[key]
    homes = [f"{name}.{key}" for name, cls in SECTIONS.items() if key in cls.model_fields]
    return " or ".join(homes) or None


def _moved_keys(data: dict, fields: Mapping[str, object]) -> str:
    """What is wrong with the keys of ``data`` that are not ``fields`` when one
    of them at least belongs elsewhere; "" when none does (then pydantic's own
    error for unknown keys says enough)."""
    unknown = [k for k in data if k not in fields]
    homes = {k: _home(k) for k in unknown}
    if not any(homes.values()):
        return ""
    return "; ".join(
        f"{k} is unknown"
        if where is None
        else f"{k} is {where}"
        if where.startswith("no longer")
        else f"{k} is now {where}"
        for k, where in homes.items()
    )


def _moved_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("moved_key", "{message}", {"message": message})


def _set_path(data: dict, dotted: str, value: object) -> None:
    *sections, key = dotted.split(".")
    for name in sections:
        data = data.setdefault(name, {})
        if not isinstance(data, dict):
            raise ValueError(f"{name}: expected a mapping of its keys, got {data!r}")
    data[key] = value


def describe_errors(e: ValidationError) -> list[str]:
    """One line per error: where (a dotted path) and what."""
    lines = []
    for err in e.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}")
    return lines
