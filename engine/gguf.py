"""GGUF files (llama.cpp's format): metadata -> a Hugging Face config, and the weights.

The file is read with ``gguf`` (gguf-py, maintained in the llama.cpp repository)
rather than a parser of our own: it follows the format as llama.cpp extends it
and brings the block layouts' dequantization (``gguf.quants``). Parsing a file's
metadata with it takes seconds (every vocabulary entry is a field part), so
``engine/gguf_model.py`` does it once per file and caches what it found.

Weights: ``stored_tensors`` gives each tensor as stored (quantized blocks or
floats, :class:`StoredTensor`) under the Hugging Face name, with llama.cpp's
permutation of the q/k rows undone; ``dequantized_state`` turns them into the
float state dict ``LlamaModel`` takes. A kernel for a quantized type can take
the ``StoredTensor`` rows as they are: the row permutation moves whole rows, so
it leaves the blocks intact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import UnsupportedModelError

FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}  # and BF16, read as raw 16-bit words
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:
        raise ImportError("loading a .gguf model needs the 'gguf' package: pip install gguf") from e
    return gguf


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if gguf_name == "rope_freqs.weight":  # kept, for hf_config_dict to refuse by name
        return gguf_name
    m = _BLOCK.fullmatch(gguf_name)
    if m is not None and m.group(2) in _LAYER_NAMES:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_NAMES and kind in ("weight", "bias"):
        return f"{_TOP_NAMES[base]}.{kind}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a Llama model")


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor's bytes are in the file and how they are stored."""

    name: str  # Hugging Face name
    ggml_type: str  # gguf.GGMLQuantizationType name: F32, F16, Q8_0, Q4_1 ...
    shape: tuple[int, ...]  # torch order: [out, in] for a matrix
    offset: int  # from the start of the file
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ggml_type": self.ggml_type,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorEntry:
        return cls(d["name"], d["ggml_type"], tuple(d["shape"]), d["offset"], d["nbytes"])


@dataclass(frozen=True)
class GGUFHeader:
    """What the loader needs from a file's metadata."""

    architecture: str
    metadata: dict[str, Any]  # scalar and string fields, plus the tokenizer's arrays
    tensors: tuple[TensorEntry, ...]
    data_offset: int  # where the tensor data starts: the header is everything before


def read_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s metadata and tensor table with gguf-py (seconds for a large
    vocabulary; the weights are not read)."""
    gguf = _require_gguf()
    reader = gguf.GGUFReader(str(path), "r")
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    arch = str(metadata.get("general.architecture", ""))
    tensors = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        tensors.append(
            TensorEntry(
                hf_name(t.name) if arch in SUPPORTED_GGUF_ARCHITECTURES else t.name,
                t.tensor_type.name,
                shape,
                int(t.data_offset),
                int(t.n_bytes),
            )
        )
    return GGUFHeader(arch, metadata, tuple(tensors), int(reader.data_offset))


def hf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """``LlamaConfig`` arguments from the metadata (llama.cpp's key names)."""
    arch, md = header.architecture, header.metadata
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in header.tensors}

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    if "rope_freqs.weight" in names:
        raise UnsupportedModelError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(md.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(md.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings ({rope_dim} of {head_dim})")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e4))}
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = md.get(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    embed = next(t for t in header.tensors if t.name == "model.embed_tokens.weight")
    ids = {
        f"{k}_token_id": md.get(f"tokenizer.ggml.{g}_token_id")
        for k, g in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(vocab or embed.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(md.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_parameters": rope,
        "tie_word_embeddings": "lm_head.weight" not in names,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in names,
        "mlp_bias": "model.layers.0.mlp.gate_proj.bias" in names,
        "hidden_act": "silu",
        "dtype": "float32",
        **{k: int(v) for k, v in ids.items() if v is not None},
    }


# ---------------------------------------------------------------------------
# Weights


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the file stores it, rows in the Hugging Face order.

    ``data``: for F32/F16, the values, ``shape``; for BF16 their uint16 words;
    for a block type (Q8_0, Q4_1 ...), uint8 ``[rows, row_bytes]`` with each row
    the blocks of one output channel (``shape`` = ``[rows, in_features]``).
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in (*FLOAT_TYPES, "BF16")

    def dequantize(self) -> torch.Tensor:
        """The values as a float32 tensor of ``shape``."""
        if self.ggml_type in FLOAT_TYPES:
            return torch.from_numpy(self.data.astype(np.float32)).reshape(self.shape)
        if self.ggml_type == "BF16":
            words = self.data.astype(np.uint32) << 16
            return torch.from_numpy(words.view(np.float32)).reshape(self.shape)
        gguf = _require_gguf()
        qtype = gguf.GGMLQuantizationType[self.ggml_type]
        values = gguf.quants.dequantize(self.data, qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)


def _raw(file: np.ndarray, entry: TensorEntry) -> np.ndarray:
    buf = file[entry.offset : entry.offset + entry.nbytes]
    if entry.ggml_type in FLOAT_TYPES:
        return buf.view(FLOAT_TYPES[entry.ggml_type]).reshape(entry.shape)
    if entry.ggml_type == "BF16":
        return buf.view(np.uint16).reshape(entry.shape)
    rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
    return buf.reshape(rows, entry.nbytes // rows)


def qk_row_order(rows: int, heads: int) -> np.ndarray:
    """The row index that undoes llama.cpp's q/k permutation (convert_hf_to_gguf.py
    interleaves the two rotary halves of each head; transformers' GGUF loader
    reverses it the same way): ``hf_rows = gguf_rows[qk_row_order(...)]``."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def stored_tensors(
    path: Path, entries: list[TensorEntry], config: dict[str, Any]
) -> dict[str, StoredTensor]:
    """Every tensor of the file, by Hugging Face name, as stored (memory-mapped;
    the q/k rows are copied into the Hugging Face order)."""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out = {}
    for e in entries:
        data = _raw(file, e)
        proj = e.name.split(".")[-2]
        if proj in heads and e.name.startswith("model.layers."):
            data = data[qk_row_order(e.shape[0], heads[proj])]
        out[e.name] = StoredTensor(e.name, e.ggml_type, e.shape, data)
    return out


def dequantized_state(tensors: dict[str, StoredTensor]) -> dict[str, torch.Tensor]:
    """The float32 state dict (Hugging Face names) of ``stored_tensors``."""
    return {name: t.dequantize() for name, t in tensors.items()}
