"""What the engine builds around a simulated model (engine/simulated.py):
its spec, KV layout and pool size, from ``EngineConfig.simulate``'s profile."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig, ModelSpec
from engine.kv_layout import KVLayout
from engine.simulated import SIM_HEAD_DIM, SIM_KV_HEADS, SIM_LAYERS, SimulatedModel
from planner.profile import Profile
from planner.profiles import load_profile, profile_path

SIM_ARCHITECTURE = "SimulatedForCausalLM"
DEFAULT_MAX_MODEL_LEN = 32768  # when the profile does not say


@dataclass(frozen=True)
class SimulatedSetup:
    """A simulated model and what the engine needs to know of it."""

    model: SimulatedModel
    spec: ModelSpec
    kv_layout: KVLayout
    num_blocks: int
    profile_path: Path  # the engine's model_dir


def simulated_setup(
    config: EngineConfig, vocab_size: int | None, eos_token_ids: set[int]
) -> SimulatedSetup:
    """The simulated model of ``config.simulate`` (``vocab_size``: a
    tokenizer's, else the profile's; it never emits ``eos_token_ids``)."""
    assert config.simulate is not None
    profile = load_profile(config.simulate)
    spec = simulated_spec(profile, vocab_size or profile.vocab_size)
    identity = f"simulated:v1:{spec.vocab_size}:{profile.to_json()}".encode()
    layout = KVLayout(
        model_fingerprint=hashlib.sha256(identity).hexdigest()[:32],
        dtype=config.dtype,
        num_layers=spec.num_layers,
        block_size=config.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
    )
    num_blocks = config.num_kv_blocks or simulated_blocks(
        profile, config.kv_cache_memory_bytes, config.block_size
    )
    model = SimulatedModel(profile, spec.vocab_size, eos_token_ids, config.block_size)
    return SimulatedSetup(model, spec, layout, num_blocks, profile_path(config.simulate))


def simulated_spec(profile: Profile, vocab_size: int) -> ModelSpec:
    return ModelSpec(
        architecture=SIM_ARCHITECTURE,
        vocab_size=vocab_size,
        hidden_size=SIM_HEAD_DIM,
        intermediate_size=SIM_HEAD_DIM,
        num_layers=SIM_LAYERS,
        num_heads=SIM_KV_HEADS,
        num_kv_heads=SIM_KV_HEADS,
        head_dim=SIM_HEAD_DIM,
        rms_norm_eps=1e-6,
        max_position_embeddings=profile.max_model_len or DEFAULT_MAX_MODEL_LEN,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding_window=None,
        eos_token_ids=(),
    )


def simulated_blocks(profile: Profile, memory_bytes: int, block_size: int) -> int:
    """Blocks of a pool of ``memory_bytes`` of the real model's KV (its
    ``kv_bytes_per_token``): a simulated worker holds as many tokens as the
    real one would."""
    per_token = profile.kv_bytes_per_token or SIM_LAYERS * 2 * SIM_KV_HEADS * SIM_HEAD_DIM * 4
    return max(1, memory_bytes // (per_token * block_size))
