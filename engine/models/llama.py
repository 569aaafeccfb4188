"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

Plain tensors and functional ops: q/k/v and gate/up projections are fused
at load time, so a layer is a handful of matmuls. Weight matrices are kept
transposed, [in, out], and applied with ``x @ w``: on CPU that GEMM path
reads a one-row (decode) input faster than ``F.linear`` over the [out, in]
layout (docs/benchmarks.md). The numerics follow the
Hugging Face implementation (fp32 RMSNorm, rotate-half RoPE) so greedy
output matches it token for token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelSpec
from engine.kernels import HalfHead, Int8Head, PackedWeight, screen_for
from engine.kernels import matrix_units as use_matrix_units
from engine.kv_cache import KVCache
from engine.quant import AT_LOAD, HEAD_AT_LOAD, QuantFormat, Quantization, QuantWeight
from engine.row_invariant import each_row, whole

log = logging.getLogger(__name__)

# PackedWeight on the fused CPU path, QuantWeight with quantization
Weight = torch.Tensor | PackedWeight | QuantWeight
# A row whose screen leaves more columns that could hold its argmax for the
# exact float32 sums gets its full logits (the default model's rows leave 1 to
# 7 with the int8 screen).
MAX_CANDIDATES = 64
# A model whose rows the screen mostly cannot settle (hidden states with a few
# huge components quantize coarsely) pays for the screen and then the full
# logits: after SCREEN_TRIAL_ROWS rows, a miss rate above this drops the screen.
SCREEN_TRIAL_ROWS = 512
SCREEN_GIVE_UP_RATE = 0.5


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [hidden, (heads + 2 * kv_heads) * head_dim]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Weight  # [hidden, 2 * intermediate]
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None


def rope_tables(hf_config: Any, spec: ModelSpec, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_len, head_dim] each, computed as transformers does."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = spec.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    elif rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' is not supported")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' order of operations, in fp32 (F.rms_norm is slower on CPU).
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, QuantWeight):
        return w.apply(x, bias, None)
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


def _dequantized(w: Weight, dtype: torch.dtype) -> Weight:
    """A quantized matrix as a float [in, out] one (the PyTorch path's layout)."""
    return w.dequantize(dtype).t().contiguous() if isinstance(w, QuantWeight) else w


def _pack(w: Weight) -> Weight:
    """A float [in, out] matrix packed for the linear kernel; a quantized one as it is."""
    return PackedWeight.pack(w) if isinstance(w, torch.Tensor) else w


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    def __init__(
        self,
        spec: ModelSpec,
        state: dict[str, torch.Tensor],
        hf_config: Any,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Any = None,
        *,
        greedy_screen: bool = True,
        quantization: Quantization = "none",
        deterministic: bool = False,
        gpu_attention: bool = False,
        matrix_units: bool = False,
    ) -> None:
        """``kernels``: engine.kernels.cpu_ops() to run the fused CPU path, or None.
        ``greedy_screen``: with kernels, an int8 or float16 copy of the head screens
        greedy steps (engine.kernels.screen_for); not with a quantized head.
        ``quantization``: int8 or q4 quantize the matrices (engine/quant.py);
        as_stored keeps the QuantWeight values of ``state`` (a GGUF file's) as they
        are and the float ones in float.
        ``deterministic``: each row's arithmetic does not depend on the other rows
        of the batch (docs/deterministic.md): torch ops run a row at a time, the
        quantized kernel on its integer path; no greedy screen.
        ``gpu_attention``: attention goes through the Triton kernel that reads the
        paged cache in place (engine/gpu/); callers build metadata for it.
        ``matrix_units``: with kernels, where engine.kernels.matrix_units holds,
        quantized matmuls of many rows run in bfloat16 on the matrix tiles
        (QuantWeight.apply's ``dense``); not in deterministic mode."""
        self.spec = spec
        # A tensor-parallel rank's model (engine/parallel/) holds its share of the
        # weights (``spec`` and ``state`` are the share's) and sets this to the sum
        # over the ranks of the o and down projections' partial outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _unchanged
        self.deterministic = deterministic
        self.gpu_attention = gpu_attention
        self.rows = each_row if deterministic else whole  # how row-local torch code runs
        self.kernels = kernels
        self.dense = (
            matrix_units and kernels is not None and not deterministic and use_matrix_units(kernels)
        )
        self.scale = spec.head_dim**-0.5
        # Called with a layer's index once forward has written its KV (the
        # engine's reports to a prefill that streams its KV out).
        self.after_layer: Callable[[int], None] | None = None

        fmt = AT_LOAD.get(quantization)
        self.quantized = fmt is not None or quantization == "as_stored"

        def take(name: str) -> torch.Tensor:
            value = state[name]
            if isinstance(value, QuantWeight):  # a quantized tensor kept as a float one
                value = value.dequantize()
            return value.to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in state else None

        def cat(names: list[str]) -> torch.Tensor | None:
            parts = [maybe(n) for n in names]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError(f"checkpoint has only some of {names}")
            return torch.cat(parts).contiguous()

        def matrix(names: list[str], fmt: QuantFormat | None = fmt) -> Weight:
            """The [out, in] weights of ``names`` stacked: [in, out] float, or quantized
            (to ``fmt`` when the setting quantizes at load; parts quantized to it
            already, a tensor-parallel rank's share of a whole matrix, stay)."""
            parts = [state[n] for n in names]
            stored = [p for p in parts if isinstance(p, QuantWeight)]
            kinds = {(p.format, p.in_features) for p in stored}
            keep = quantization == "as_stored" or {p.format for p in stored} == {fmt}
            if keep and len(stored) == len(parts) and len(kinds) == 1:
                # one part: its own tensors (a tied head shares the embedding's bytes)
                return (stored[0] if len(stored) == 1 else QuantWeight.cat(stored)).to(device)
            w = cat(names)
            if fmt is not None:
                return QuantWeight.quantize(w, fmt)
            return w.t().contiguous()

        self.dtype = dtype
        embed = state["model.embed_tokens.weight"]
        # as_stored keeps a quantized table as it is: a lookup dequantizes its rows
        keep = quantization == "as_stored" and isinstance(embed, QuantWeight)
        self.embed: torch.Tensor | QuantWeight = (
            embed.to(device) if keep else take("model.embed_tokens.weight")
        )
        head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        self.lm_head = matrix([head], HEAD_AT_LOAD.get(quantization))
        self.norm = take("model.norm.weight")
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=matrix([attn + f"{x}_proj.weight" for x in "qkv"]),
                    qkv_bias=cat([attn + f"{x}_proj.bias" for x in "qkv"]),
                    q_norm=maybe(attn + "q_norm.weight"),
                    k_norm=maybe(attn + "k_norm.weight"),
                    o=matrix([attn + "o_proj.weight"]),
                    o_bias=maybe(attn + "o_proj.bias"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=matrix([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
                    gate_up_bias=cat([mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
                    down=matrix([mlp + "down_proj.weight"]),
                    down_bias=maybe(mlp + "down_proj.bias"),
                )
            )
        cos, sin = rope_tables(hf_config, spec, max_len)
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.screen_head: Int8Head | HalfHead | None = None
        self.screen_rows = self.screen_misses = 0  # rows screened, and left unsettled
        self.screen_max_rows = 1 << 30  # more rows at once get the full logits
        if deterministic and kernels is None:  # a row at a time: dequantize once, not per row
            self.lm_head = _dequantized(self.lm_head, dtype)
            for w in self.layers:
                w.qkv, w.o, w.gate_up, w.down = (
                    _dequantized(m, dtype) for m in (w.qkv, w.o, w.gate_up, w.down)
                )
        if kernels is not None:  # one copy of each matrix, in the linear kernel's layout
            self.lm_head = _pack(self.lm_head)
            screenable = isinstance(self.lm_head, PackedWeight)  # not a quantized head
            screenable = screenable and not deterministic  # its batch cut-off picks the path
            if screenable and greedy_screen and hasattr(kernels, "greedy_head_i8"):
                self.screen_head = screen_for(self.lm_head, kernels.INT8_ROW_LEVELS)
                if isinstance(self.screen_head, HalfHead):
                    self.screen_max_rows = kernels.HALF_SCREEN_MAX_ROWS
            for w in self.layers:
                w.qkv, w.o, w.down = (_pack(m) for m in (w.qkv, w.o, w.down))
                if isinstance(w.gate_up, torch.Tensor):  # for linear_silu_mul
                    w.gate_up = PackedWeight.pack_gate_up(w.gate_up)
                    w.gate_up_bias = PackedWeight.pad_gate_up_bias(w.gate_up_bias)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``, [N, hidden], a fresh tensor."""
        table = self.embed
        if isinstance(table, torch.Tensor):
            return table[input_ids]
        scales = None if table.scales is None else table.scales[input_ids]
        rows = QuantWeight(table.format, table.data[input_ids], scales, table.in_features)
        return rows.dequantize(self.dtype)

    @property
    def fused(self) -> bool:
        """Whether forward takes metadata built with ``fused=True``."""
        return self.kernels is not None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:  # [N, hidden]
        if self.kernels is not None:
            return self._forward_fused(input_ids, positions, meta, cache)
        spec = self.spec
        heads, rows = spec.num_heads, self.rows
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        h = self._embed(input_ids)
        for i, w in enumerate(self.layers):
            qk, v = rows(lambda h, cos, sin, w=w: self._qkv(h, w, cos, sin), h, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            attn = paged_attention(q, k, v, cache, i, meta, self.scale)
            h = rows(lambda h, attn, w=w: self._mlp(h, attn, w), h, attn)
            if self.after_layer is not None:  # past the reduces: every rank wrote its KV
                self.after_layer(i)
        return rows(lambda h: _rms_norm(h, self.norm, spec.rms_norm_eps), h)

    def _qkv(
        self, h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the residual stream to their queries and keys (RoPE applied),
        [N, heads + kv_heads, head_dim], and values: the PyTorch path."""
        spec = self.spec
        eps, d, heads = spec.rms_norm_eps, spec.head_dim, spec.num_heads
        qkv = _linear(_rms_norm(h, w.input_norm, eps), w.qkv, w.qkv_bias)
        n, kv_size = qkv.shape[0], spec.num_kv_heads * d
        v = qkv[:, heads * d + kv_size :].view(n, spec.num_kv_heads, d)
        qk = qkv[:, : heads * d + kv_size].view(n, heads + spec.num_kv_heads, d)
        if w.q_norm is not None:
            q = _rms_norm(qk[:, :heads], w.q_norm, eps)
            k = _rms_norm(qk[:, heads:], w.k_norm, eps)
            qk = torch.cat((q, k), dim=1)
        return _rotate(qk, cos, sin), v  # queries and keys in one pass

    def _mlp(self, h: torch.Tensor, attn: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """The residual stream after a layer's output projection and MLP: the PyTorch path."""
        eps = self.spec.rms_norm_eps
        h = h + self.reduce(_linear(attn, w.o, w.o_bias))
        gate, up = _linear(_rms_norm(h, w.post_norm, eps), w.gate_up, w.gate_up_bias).chunk(2, -1)
        return h + self.reduce(_linear(F.silu(gate) * up, w.down, w.down_bias))

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        """forward with the fused CPU kernels: the same arithmetic in 7 calls a
        layer, the matmuls included (weights packed in panels)."""
        ops, spec = self.kernels, self.spec
        eps, d, heads, kv_heads = (
            spec.rms_norm_eps,
            spec.head_dim,
            spec.num_heads,
            spec.num_kv_heads,
        )

        def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
            if isinstance(w, QuantWeight):
                return w.apply(x, bias, ops, self.deterministic, self.dense)
            return ops.linear(x, w.panels, w.out_features, bias)  # a row's sums are its own

        h = self._embed(input_ids)  # a fresh tensor: the residual stream, updated in place
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for i, w in enumerate(self.layers):
            qkv = linear(x, w.qkv, w.qkv_bias)
            n = qkv.shape[0]
            if w.q_norm is not None:
                qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
                rows = self.rows
                qk[:, :heads] = rows(lambda x, w=w: _rms_norm(x, w.q_norm, eps), qk[:, :heads])
                qk[:, heads:] = rows(lambda x, w=w: _rms_norm(x, w.k_norm, eps), qk[:, heads:])
            ops.rope_store_kv(
                qkv, self.cos, self.sin, positions, meta.slots, cache.layers[i], heads, kv_heads
            )
            q = qkv[:, : heads * d].view(n, heads, d)
            k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
            v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
            attn = paged_attention(q, k, v, cache, i, meta, self.scale, ops)
            x = ops.add_rms_norm(h, self.reduce(linear(attn, w.o, w.o_bias)), w.post_norm, eps)
            if self.after_layer is not None:  # past the reduce: every rank wrote its KV
                self.after_layer(i)
            gate_up = w.gate_up
            if isinstance(gate_up, QuantWeight):
                hidden = ops.silu_mul(linear(x, gate_up, w.gate_up_bias))
            else:
                hidden = ops.linear_silu_mul(
                    x, gate_up.panels, gate_up.out_features, w.gate_up_bias
                )
            down = self.reduce(linear(hidden, w.down, w.down_bias))
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(h, down, following, eps)
        return x

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> list[int]:
        """The argmax of each row's logits over the first ``vocab_size`` columns,
        the same token as ``logits`` then argmax, from a screen of the head
        (greedy_head_*, engine/kernels/head_*.cpp); needs ``screen_head``. Rows
        the screen cannot settle get their full logits, and so do batches of more than
        ``screen_max_rows`` rows (cpu_ops.HALF_SCREEN_MAX_ROWS for a float16
        screen)."""
        head, screen = self.lm_head, self.screen_head
        assert isinstance(head, PackedWeight) and screen is not None, "no screened head"
        x = hidden.contiguous()
        if len(x) > self.screen_max_rows:  # the screen would cost more than it saves
            return self._full_argmax(x, vocab_size)
        screened = screen.tokens(self.kernels, x, head, vocab_size, MAX_CANDIDATES)
        tokens = screened.tolist()  # checked in Python: no tensor op when every row settles
        unsettled = [i for i, t in enumerate(tokens) if t < 0]
        self._count_screen(len(tokens), len(unsettled))
        if unsettled:
            best = self._full_argmax(x[unsettled], vocab_size)
            for i, t in zip(unsettled, best, strict=True):
                tokens[i] = t
        return tokens

    def _full_argmax(self, x: torch.Tensor, vocab_size: int) -> list[int]:
        """Each row's argmax over its full float32 logits (the packed head)."""
        ops, head = self.kernels, self.lm_head
        if isinstance(head, QuantWeight):
            full = head.apply(x, None, ops)
        else:
            full = ops.linear(x, head.panels, head.out_features)
        return ops.argmax_rows(full[:, :vocab_size].contiguous()).tolist()

    def _count_screen(self, rows: int, misses: int) -> None:
        self.screen_rows += rows
        self.screen_misses += misses
        if self.screen_rows < SCREEN_TRIAL_ROWS:
            return
        if self.screen_misses > SCREEN_GIVE_UP_RATE * self.screen_rows:
            log.warning(
                "the greedy screen settled %d of %d rows: computing full logits from now on",
                self.screen_rows - self.screen_misses,
                self.screen_rows,
            )
            self.screen_head = None  # the engine checks it before each greedy step

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, vocab]
        head = self.lm_head
        if isinstance(head, PackedWeight):
            return self.kernels.linear(hidden.contiguous(), head.panels, head.out_features)
        if isinstance(head, QuantWeight):
            return head.apply(hidden, None, self.kernels, self.deterministic, self.dense).float()
        return self.rows(lambda x: torch.mm(x, head), hidden).float()
