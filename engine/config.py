"""Model spec (read from a Hugging Face config) and engine options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_MODEL_NAME = "tandem-tiny-llama"  # the embedded model (EngineConfig.model None)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder, independent of where weights live."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        archs = list(getattr(config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or config.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window = getattr(config, "sliding_window", None)
        if is_qwen2 and not getattr(config, "use_sliding_window", False):
            window = None
        eos = config.eos_token_id
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of one engine (see engine/spec/)."""

    method: Literal["ngram", "draft"] = "ngram"
    """ngram: prompt lookup (proposes what followed the last n-gram earlier in the
    sequence); draft: a smaller model sharing the tokenizer proposes."""
    num_speculative_tokens: int = 4
    """Tokens proposed per sequence and step (k); the target verifies k + 1 positions."""
    ngram_max: int = 4
    """Longest n-gram the prompt-lookup proposer matches."""
    ngram_min: int = 1
    """Shortest n-gram the prompt-lookup proposer matches."""
    draft_model: str | None = None
    """Checkpoint directory or hub id of the draft model (method 'draft'); loaded with
    the target's load_format, dtype, device and seed."""
    draft_num_kv_blocks: int | None = None
    """Blocks of the draft model's own KV pool; None: as many as the target's pool."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model")
        if self.draft_num_kv_blocks is not None and self.draft_num_kv_blocks < 1:
            raise ValueError(f"draft_num_kv_blocks must be >= 1, got {self.draft_num_kv_blocks}")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance (one worker)."""

    model: str | None = None
    """Checkpoint directory or hub id; None builds and uses the embedded default model."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id; defaults to the model's."""
    load_format: Literal["auto", "dummy"] = "auto"
    """'dummy' gives random weights of the model's config (benchmarks)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and KV cache dtype."""
    device: str = "auto"
    """torch device of the weights and the KV cache; 'auto': cuda where available, else cpu."""
    seed: int = 0
    """Seed of the global RNG (dummy weights, sampling without a per-request seed)."""
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """Blocks in the pool; derived from kv_cache_memory_bytes when None."""
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    """Memory of the KV block pool when num_kv_blocks is None."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (chunked prefill splits prompts to fit it)."""
    max_num_seqs: int = 256
    """Most sequences running at once."""
    max_model_len: int | None = None
    """Longest prompt plus output; defaults to the model's limit, capped by the pool."""
    enable_prefix_caching: bool = True
    """Keep full blocks of finished requests for reuse by later ones with the same prefix."""
    num_threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding of running sequences; None decodes one token per step."""
    kv_transfer_dtype: Literal["auto", "int8", "fp8"] = "auto"
    """Encoding of KV blocks sent to other workers: auto sends the cache's dtype;
    int8 / fp8 (e4m3) send one byte per value with a scale per block, layer, K/V
    and kv head (kv_transfer/quantized.py). Every worker of a deployment must
    use the same value."""
    cpu_kernels: Literal["auto", "on", "off"] = "auto"
    """Fused C++ kernels for the float32 CPU forward (engine/kernels/): auto builds
    them on first use (needs a C++ compiler; cached) and falls back to the PyTorch
    path when they cannot be built; on makes that an error; off never builds them."""
    greedy_screen: bool = True
    """With the CPU kernels (on a CPU with AVX2, F16C and FMA): keep a smaller copy
    of the LM head (int8 up to a hidden size of 512, float16 above) and pick
    plain-greedy tokens by screening it, recomputing only the candidate columns in
    float32; the tokens equal the full logits' argmax. Costs 1 or 2 bytes per head
    weight of memory; False computes the full float32 logits."""
    matrix_units: bool = True
    """With the CPU kernels and quantized weights, on a CPU with AMX-BF16: a matmul
    of 128 rows or more (a prefill, a large batch) dequantizes its matrix into
    bfloat16 for that call and runs torch's bfloat16 matmul on the matrix tiles (engine/quant.py);
    the weights stay quantized in memory, plus one scratch matrix the size of the
    largest. False keeps every matmul on the integer kernels."""
    quantization: Literal["auto", "none", "int8", "q4", "as_stored"] = "auto"
    """Weights of the linear layers and the LM head: auto is int8 for the packaged
    SmolLM2-135M-Instruct and none for every other model; none keeps the checkpoint's
    floats (a GGUF file's quantized tensors dequantized); int8 quantizes them at
    load per output channel (symmetric, a float32 scale a row); q4 to 4-bit blocks
    of 32 with a float16 scale and min (GGUF's Q4_1); as_stored keeps a GGUF file's
    Q8_0, Q4_0 and Q4_1 tensors as they are (the same as none for other
    checkpoints). CPU kernels multiply from the quantized bytes; without them
    (or on a GPU) the weights are dequantized on the fly for torch's matmul."""
    cuda_graphs: bool = False
    """Replay decode-only steps as CUDA graphs captured at fixed batch sizes (CUDA only;
    ignored on other devices). One KV block is set aside for padding rows."""
    attention: Literal["auto", "triton", "sdpa"] = "auto"
    """How attention reads the paged KV cache: auto is triton on a GPU where Triton is
    installed (not in deterministic mode) and sdpa elsewhere; triton, one kernel that
    reads the blocks in place (engine/gpu/, docs/gpu.md); sdpa gathers each
    sequence's blocks and calls PyTorch's scaled_dot_product_attention. On CPU the
    fused kernels (cpu_kernels) take precedence over sdpa."""
    simulate: str | None = None
    """A profile file or a shipped profile's name (planner/profiles/): the simulated
    model (engine/simulated.py) replaces the model's forward pass by the profile's
    step time, slept, and deterministic tokens; model and load_format are then not
    used, kv_cache_memory_bytes counts the profiled model's KV bytes per token."""
    kv_tier_num_blocks: int | None = None
    """Blocks of the second KV tier (engine/kv_tier.py), where cached blocks evicted
    from the pool go and prefix hits take them back from; None: derived from
    kv_tier_memory_bytes."""
    kv_tier_memory_bytes: int = 0
    """Size of the second KV tier when kv_tier_num_blocks is None; 0: no tier. Pinned
    host memory behind a GPU pool, a memory-mapped file behind a CPU pool."""
    kv_tier_dir: str | None = None
    """Directory of a CPU pool's tier file (created 0600 and unlinked once mapped);
    None: $XDG_STATE_HOME/tandem/kv-tier."""
    deterministic: bool = False
    """Greedy and seeded outputs, tokens and logprobs, bit-identical whatever else
    is in the batch, however the prompt is chunked, after a prefix hit and when
    a sequence is prefilled again elsewhere (docs/deterministic.md): every row
    runs through kernels whose arithmetic does not depend on the other rows.
    Slower; refuses lossy KV transfer, speculative decoding and CUDA graphs."""
    tensor_parallel_size: int = 1
    """Ranks (processes, one device each) the model is split over
    (engine/parallel/): attention heads, kv heads, the MLP and the LM head's
    vocabulary; each rank's KV cache holds its kv heads, kv_cache_memory_bytes
    each. The heads, kv heads and intermediate size must divide by it. Not with
    speculative decoding, CUDA graphs, a second KV tier, a quantized KV wire,
    quantization as_stored, deterministic mode or a simulated model."""

    def __post_init__(self) -> None:
        checks = {
            "block_size": self.block_size >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes >= 1,
            "num_kv_blocks": self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "max_model_len": self.max_model_len is None or self.max_model_len >= 1,
            "num_threads": self.num_threads is None or self.num_threads >= 1,
            "kv_tier_num_blocks": self.kv_tier_num_blocks is None or self.kv_tier_num_blocks >= 1,
            "tensor_parallel_size": self.tensor_parallel_size >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.kv_tier_memory_bytes < 0:
            raise ValueError(f"kv_tier_memory_bytes must be >= 0, got {self.kv_tier_memory_bytes}")
        if self.simulate is not None:
            self._check_simulated()
        if self.deterministic:
            self._check_deterministic()
        if self.tensor_parallel_size > 1 and (why := tensor_parallel_conflict(self)) is not None:
            raise ValueError(why)

    def _check_simulated(self) -> None:
        """What a simulated model cannot do (engine/simulated.py)."""
        if self.speculative is not None:
            raise ValueError("simulate: speculative decoding is not simulated")
        if self.dtype != "float32":
            raise ValueError("simulate: the simulated KV cache is float32 (dtype float32)")
        if self.kv_transfer_dtype != "auto":
            raise ValueError("simulate: KV moves as stored (kv_transfer_dtype auto)")

    def _check_deterministic(self) -> None:
        """What deterministic mode cannot keep bit-identical (docs/deterministic.md)."""
        why = deterministic_conflict(
            self.kv_transfer_dtype, self.speculative is not None, self.cuda_graphs,
            self.attention,
        )  # fmt: skip
        if why is not None:
            raise ValueError(why)


def deterministic_conflict(
    transfer_dtype: str, speculative: bool, cuda_graphs: bool, attention: str = "auto"
) -> str | None:
    """Why these settings break deterministic mode's promise, or None (EngineConfig's
    check and the serve config's, so both say the same)."""
    if transfer_dtype != "auto":
        return (
            f"deterministic: KV transfer {transfer_dtype} is lossy (the decode worker would "
            "read other values than the prefill worker wrote); use transfer dtype auto"
        )
    if speculative:
        return (
            "deterministic: speculative decoding verifies as many proposed tokens as the "
            "step's budget leaves, so seeded draws would depend on the batch; turn it off"
        )
    if cuda_graphs:
        return (
            "deterministic: CUDA graphs are captured for decode steps, which this mode "
            "runs as one-token prefills, so they would never replay; turn cuda_graphs off"
        )
    if attention == "triton":
        return (
            "deterministic: the Triton attention kernel splits a decode row's keys by the "
            "batch's shape, so its sums depend on the batch; use attention auto or sdpa"
        )
    return None


def tensor_parallel_conflict(config: EngineConfig, tp: int | None = None) -> str | None:
    """Why ``config`` cannot run at ``tp`` ranks (None: its tensor_parallel_size),
    or None (EngineConfig's check and the serve config's, so both say the same)."""
    tp = tp or config.tensor_parallel_size
    refused = {
        "simulate": config.simulate is not None,
        "speculative decoding": config.speculative is not None,
        "cuda_graphs": config.cuda_graphs,
        "a second KV tier": bool(config.kv_tier_num_blocks or config.kv_tier_memory_bytes),
        f"kv_transfer_dtype {config.kv_transfer_dtype}": config.kv_transfer_dtype != "auto",
        "quantization as_stored (GGUF blocks do not split between ranks)": (
            config.quantization == "as_stored"
        ),
        "deterministic mode (the ranks' partial sums are added in an order that depends "
        "on the batch, and differs between tensor-parallel sizes)": config.deterministic,
    }
    for what, on in refused.items():
        if on:
            return f"tensor_parallel_size {tp} is not supported with {what}"
    return None
