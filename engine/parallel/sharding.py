"""Which part of each weight a tensor-parallel rank holds.

Megatron's split of a Llama layer, over ``tp`` ranks:

- column-parallel (each rank some output features, no communication): q, k
  and v (rank r: query heads [r*H/tp, (r+1)*H/tp) and the kv heads they
  attend with, [r*K/tp, (r+1)*K/tp)), gate and up (an equal share of the
  intermediate features), and the LM head (a share of the vocabulary);
- row-parallel (each rank the input features the column-parallel layer before
  it produced; partial sums added by an all-reduce): o and down. Their bias is
  rank 0's alone, so the all-reduce adds it once;
- replicated: the embedding table and the norms.

A rank's weights are then a model of the same family with fewer heads and a
narrower MLP (``rank_spec``), so engine/models/llama.py runs them unchanged
but for the all-reduce after o and down.

Quantized at load (engine/quant.py), a rank's share holds the same codes and
scales as the whole matrix quantized at one rank: the formats quantize each
row, or each block of 32 inputs of a row, on its own, so a share of rows (or
of whole blocks) quantized alone is that part of the whole. int8's scale
spans a whole row, so o and down (split by inputs) are quantized whole and
then cut, at block boundaries.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.config import ModelSpec
from engine.quant import BLOCK, BLOCK_BYTES, QuantFormat, QuantWeight


def check_splittable(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError naming what does not divide by ``tp``."""
    sizes = {
        "attention heads": spec.num_heads,
        "kv heads": spec.num_kv_heads,
        "intermediate features": spec.intermediate_size,
    }
    for what, n in sizes.items():
        if n % tp:
            raise ValueError(
                f"tensor_parallel_size {tp}: the model's {n} {what} do not split evenly "
                f"over {tp} ranks"
            )


def vocab_share(vocab_size: int, tp: int) -> int:
    """Rows of the LM head each rank holds (the last rank's padded with zeros)."""
    return -(-vocab_size // tp)


def rank_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The shape of one rank's part of the model."""
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // tp,
        num_kv_heads=spec.num_kv_heads // tp,
        intermediate_size=spec.intermediate_size // tp,
        vocab_size=vocab_share(spec.vocab_size, tp),
        tie_word_embeddings=False,  # the head is a share, the embedding whole
    )


def shard_state(
    state: dict[str, torch.Tensor | QuantWeight],
    spec: ModelSpec,
    rank: int,
    tp: int,
    quantization: str = "none",
) -> dict[str, torch.Tensor | QuantWeight]:
    """Rank ``rank``'s weights, by Hugging Face name: float tensors (a quantized
    checkpoint's matrices dequantized first; LlamaModel quantizes a share at
    load when asked), but for ``quantization`` int8's o and down, quantized
    whole and cut (see above)."""
    check_splittable(spec, tp)
    d = spec.head_dim
    q_rows = _share(spec.num_heads * d, rank, tp)
    kv_rows = _share(spec.num_kv_heads * d, rank, tp)
    mlp_rows = _share(spec.intermediate_size, rank, tp)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
    rows |= {"gate_proj": mlp_rows, "up_proj": mlp_rows}
    columns = {"o_proj": q_rows, "down_proj": mlp_rows}
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for name, value in state.items():
        w = value.dequantize() if isinstance(value, QuantWeight) else value
        *_, module, kind = name.split(".")  # e.g. model.layers.0.self_attn.q_proj.weight
        if module in rows:
            out[name] = w[rows[module]].contiguous()
        elif module in columns and kind == "weight":
            out[name] = _input_share(w, columns[module], quantization)
        elif module in columns:  # a row-parallel layer's bias: added once, by rank 0
            if rank == 0:
                out[name] = w
        elif name != "lm_head.weight":
            out[name] = w
    head = state["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
    out["lm_head.weight"] = _head_share(head, spec.vocab_size, rank, tp)
    return out


def _input_share(w: torch.Tensor, cols: slice, quantization: str) -> torch.Tensor | QuantWeight:
    """Columns ``cols`` of [out, in] ``w``; for int8 when they are whole blocks,
    the columns of ``w`` quantized whole (each row's scale over all its inputs)."""
    start, stop = cols.start, cols.stop
    if quantization != "int8" or start % BLOCK or (stop - start) % BLOCK:
        return w[:, cols].contiguous()
    whole = QuantWeight.quantize(w, QuantFormat.INT8)
    width = BLOCK_BYTES[QuantFormat.INT8] // BLOCK  # bytes a value
    data = whole.data[:, start * width : stop * width].contiguous()
    return QuantWeight(QuantFormat.INT8, data, whole.scales, stop - start)


def _share(n: int, rank: int, tp: int) -> slice:
    size = n // tp
    return slice(rank * size, (rank + 1) * size)


def _head_share(head: torch.Tensor | QuantWeight, vocab: int, rank: int, tp: int) -> torch.Tensor:
    """Rows [rank*V', (rank+1)*V') of the [vocab, hidden] head, zero rows past the vocabulary."""
    w = head.dequantize() if isinstance(head, QuantWeight) else head
    share = vocab_share(vocab, tp)
    rows = w[rank * share : min((rank + 1) * share, vocab)]
    if len(rows) == share:
        return rows.contiguous()
    padded = w.new_zeros(share, w.shape[1])
    padded[: len(rows)] = rows
    return padded
