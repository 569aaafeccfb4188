"""Quantized weights: the formats, quantizing float weights at load, and x @ W^T.

A ``QuantWeight`` is an [out, in] matrix stored row by row in blocks of 32
inputs (the last block of a row zero-padded):

- ``INT8``: per-output-channel symmetric int8, ``w = scale_row * q``, a float32
  scale a row (``quantization: int8``).
- ``Q8_0``: GGUF's Q8_0 blocks, a float16 scale and 32 int8: ``w = d * q``.
- ``Q4_0``: GGUF's Q4_0 blocks, a float16 scale and 16 bytes of 4-bit q (low
  nibbles hold the block's first 16 values): ``w = d * (q - 8)``.
- ``Q4_1``: GGUF's Q4_1 blocks, float16 scale and min, 16 bytes of q:
  ``w = d * q + m`` (``quantization: q4``).

The GGUF formats keep GGUF's bytes, so a tensor read from a GGUF file is used
as stored (``QuantWeight.from_gguf``). On CPU with the kernels built,
``cpu_ops.quant_linear`` (engine/kernels/quant_linear.cpp) multiplies from
these bytes; elsewhere (no kernels, a GPU) ``apply`` dequantizes on the fly
and runs torch's matmul. On a CPU with AMX-BF16 (``dense``), a matmul of
DENSE_ROWS rows or more (a prefill, a batch of 128 sequences or more)
dequantizes its matrix into bfloat16 (``cpu_ops.quant_dense_bf16``, into a
scratch matrix each thread keeps) and runs torch's bfloat16 matmul, which
oneDNN puts on the AMX tiles: at 128 rows that beats the integer GEMM,
1.8-2.7x at 512 (docs/cpu-kernels.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

Quantization = Literal["none", "int8", "q4", "as_stored"]
BLOCK = 32  # inputs per block
# Rows from which a ``dense`` apply runs in bfloat16 on the matrix tiles.
DENSE_ROWS = 128


class QuantFormat(IntEnum):
    """The format codes quant_linear takes."""

    INT8 = 0
    Q8_0 = 1
    Q4_0 = 2
    Q4_1 = 3


BLOCK_BYTES = {
    QuantFormat.INT8: 32,
    QuantFormat.Q8_0: 34,
    QuantFormat.Q4_0: 18,
    QuantFormat.Q4_1: 20,
}
# What a checkpoint's float weights are quantized to at load, by setting.
AT_LOAD = {"int8": QuantFormat.INT8, "q4": QuantFormat.Q4_1}
# The LM head's format at load: q4 keeps it at 8 bits (Q8_0 blocks), its
# most sensitive matrix (a tied head is the embedding, every token's input).
HEAD_AT_LOAD = {"int8": QuantFormat.INT8, "q4": QuantFormat.Q8_0}


@dataclass(frozen=True)
class QuantWeight:
    """An [out_features, in_features] weight in one of the QuantFormats."""

    format: QuantFormat
    data: torch.Tensor  # [out, blocks * BLOCK_BYTES]: int8 for INT8, else uint8
    scales: torch.Tensor | None  # float32 [out] for INT8, else None
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def blocks(self) -> int:
        return -(-self.in_features // BLOCK)

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: QuantFormat) -> QuantWeight:
        """``w`` [out, in] (any float dtype, any device) in format ``fmt``."""
        out, k = w.shape
        blocks = _blocks(w.float(), -(-k // BLOCK))  # [out, nb, 32], zero-padded
        if fmt == QuantFormat.INT8:
            flat = blocks.flatten(1)
            scale = flat.abs().amax(dim=1) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(flat / scale[:, None]).clamp(-127, 127).to(torch.int8)
            return cls(fmt, q.contiguous(), scale.contiguous(), k)
        return cls(fmt, _encode_blocks(blocks, fmt).reshape(out, -1).contiguous(), None, k)

    @classmethod
    def from_gguf(cls, fmt: QuantFormat, raw: torch.Tensor, in_features: int) -> QuantWeight:
        """A GGUF tensor's bytes as stored: ``raw`` uint8, [out, blocks * BLOCK_BYTES]
        (or flat), for a Q8_0, Q4_0 or Q4_1 tensor of ``in_features`` columns."""
        if fmt == QuantFormat.INT8:
            raise ValueError("GGUF has no per-channel int8 format")
        width = -(-in_features // BLOCK) * BLOCK_BYTES[fmt]
        if raw.dtype != torch.uint8 or raw.numel() % width:
            raise ValueError(f"{fmt.name} bytes of {raw.numel()} do not hold rows of {width}")
        return cls(fmt, raw.reshape(-1, width).contiguous(), None, in_features)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Rows of weights of one format and width, stacked (q, k, v into qkv)."""
        first = parts[0]
        if any(p.format != first.format or p.in_features != first.in_features for p in parts):
            raise ValueError("only weights of one format and input width stack")
        scales = None if first.scales is None else torch.cat([p.scales for p in parts])
        return QuantWeight(
            first.format, torch.cat([p.data for p in parts]), scales, first.in_features
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] weights the format stands for."""
        out, k, nb = self.out_features, self.in_features, self.blocks
        if self.format == QuantFormat.INT8:
            w = self.data.float() * self.scales[:, None]
        else:
            w = _decode_blocks(self.data.view(out, nb, BLOCK_BYTES[self.format]), self.format)
        return w.reshape(out, nb * BLOCK)[:, :k].to(dtype)

    def apply(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: ModuleType | None,
        row_invariant: bool = False,
        dense: bool = False,
    ) -> torch.Tensor:
        """x [M, in] @ W^T (+ bias): the CPU kernel when ``kernels``, else torch.
        ``row_invariant``: the kernel's integer path for every row count, whose sums
        for a row do not depend on the other rows (deterministic mode, whose
        PyTorch path keeps its weights dequantized instead). ``dense`` (with
        kernels, where engine.kernels.matrix_units holds): from DENSE_ROWS rows,
        bfloat16 on the matrix tiles."""
        if kernels is not None and dense and not row_invariant and x.shape[0] >= DENSE_ROWS:
            w = kernels.quant_dense_bf16(
                self.data, self.scales, int(self.format), self.in_features,
                _scratch(self.out_features, self.in_features),
            )  # fmt: skip
            y = F.linear(x.to(torch.bfloat16), w).float()
            return y if bias is None else y.add_(bias)
        if kernels is not None:
            return kernels.quant_linear(
                x.contiguous(), self.data, self.scales, int(self.format), self.out_features, bias,
                row_invariant,
            )  # fmt: skip
        w = self.dequantize(x.dtype).to(x.device)
        return F.linear(x, w, bias)

    def to(self, device: torch.device) -> QuantWeight:
        scales = None if self.scales is None else self.scales.to(device)
        return QuantWeight(self.format, self.data.to(device), scales, self.in_features)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return self.data.numel() + scales


_scratch_of = threading.local()


def _scratch(n: int, k: int) -> torch.Tensor:
    """A [n, k] bfloat16 matrix to dequantize into, one buffer a thread, grown to
    the largest asked for: a fresh one of tens of MB would be mapped page by page
    on every call (14 ms for SmolLM2's head, 3 ms to fill a mapped one)."""
    buffer = getattr(_scratch_of, "buffer", None)
    if buffer is None or buffer.numel() < n * k:
        buffer = _scratch_of.buffer = torch.empty(n * k, dtype=torch.bfloat16)
    return buffer[: n * k].view(n, k)


def _blocks(w: torch.Tensor, nb: int) -> torch.Tensor:
    padded = w.new_zeros(w.shape[0], nb * BLOCK)
    padded[:, : w.shape[1]] = w
    return padded.view(w.shape[0], nb, BLOCK)


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """[..., 1] float32 -> [..., 2] its float16's bytes (little-endian)."""
    return t.half().contiguous().view(torch.uint8)


def _encode_blocks(blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[out, nb, 32] float32 -> [out, nb, BLOCK_BYTES] uint8, as GGUF's quantizers."""
    if fmt == QuantFormat.Q8_0:
        d = (blocks.abs().amax(dim=2, keepdim=True) / 127).half().float()
        q = torch.round(blocks / torch.where(d > 0, d, 1)).clamp(-127, 127).to(torch.int8)
        return torch.cat((_half_bytes(d), q.view(torch.uint8)), dim=2)
    if fmt == QuantFormat.Q4_0:  # d = -max / 8 of the largest-magnitude value
        at = blocks.abs().argmax(dim=2, keepdim=True)
        d = (blocks.gather(2, at) / -8).half().float()
        q = torch.floor(blocks / torch.where(d != 0, d, 1) + 8.5).clamp(0, 15)
        return torch.cat((_half_bytes(d), _pack_nibbles(q)), dim=2)
    low, high = blocks.amin(dim=2, keepdim=True), blocks.amax(dim=2, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    q = torch.round((blocks - m) / torch.where(d > 0, d, 1)).clamp(0, 15)
    return torch.cat((_half_bytes(d), _half_bytes(m), _pack_nibbles(q)), dim=2)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _decode_blocks(raw: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[out, nb, BLOCK_BYTES] uint8 -> [out, nb, 32] float32."""
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    if fmt == QuantFormat.Q8_0:
        return raw[..., 2:].contiguous().view(torch.int8).float() * d
    qs = raw[..., 4:] if fmt == QuantFormat.Q4_1 else raw[..., 2:]
    q = torch.cat((qs & 15, qs >> 4), dim=-1).float()
    if fmt == QuantFormat.Q4_0:
        return (q - 8) * d
    return q * d + raw[..., 2:4].contiguous().view(torch.float16).float()
