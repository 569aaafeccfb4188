"""GGUF files written from a safetensors checkpoint, as llama.cpp's converter writes them.

``write_gguf(checkpoint_dir, out, quantize=...)``: the checkpoint's config, its
tokenizer (a byte-level BPE ``tokenizer.json``) and chat template as llama.cpp
metadata, and its weights with the q/k rows permuted the way
convert_hf_to_gguf.py permutes them; matrices are stored in the ggml type
``quantize`` names for them (one for all, or by name), quantized with gguf-py,
the rest as F32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _tokenizer_metadata(writer, ckpt: Path, cfg: dict) -> None:
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(False)
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    template = tok_config.get("chat_template")
    if template is None and (ckpt / "chat_template.jinja").is_file():
        template = (ckpt / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _type_of(name: str, quantize: str | dict[str, str] | None) -> str | None:
    """The ggml type of matrix ``name``: ``quantize`` itself, or the value of the
    first key of it that ``name`` contains (None: F32)."""
    if not isinstance(quantize, dict):
        return quantize
    return next((t for part, t in quantize.items() if part in name), None)


def write_gguf(ckpt: Path, out: Path, quantize: str | dict[str, str] | None = "Q8_0") -> Path:
    """``quantize``: one ggml type for every matrix, or types by part of the
    Hugging Face name (``{"self_attn": "Q8_0", "mlp": "Q4_0"}``), None for F32."""
    import gguf

    cfg = json.loads((ckpt / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    _tokenizer_metadata(writer, ckpt, cfg)
    state = load_file(str(ckpt / "model.safetensors"))
    for name in sorted(state):
        kind = _type_of(name, quantize)
        qtype = gguf.GGMLQuantizationType[kind] if kind else None
        w = state[name].astype(np.float32)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            w = llama_cpp_permute(w, heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            w = llama_cpp_permute(w, kv_heads)
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
