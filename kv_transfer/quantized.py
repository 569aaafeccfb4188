"""Quantized KV on the wire: one byte per value, a scale per block and head.

Opt-in per deployment (``EngineConfig.kv_transfer_dtype``). The store below
wraps a ``PoolBlockStore``: the pool keeps its own dtype, the sender
quantizes while gathering a chunk, the receiver dequantizes while writing it
into its pool. Its ``layout`` names the wire encoding (``wire_dtype``), so a
pool that expects another encoding refuses the transfer at the header, with
the field named, like any layout mismatch.

A chunk's payload (kv_transfer.proto), for each layer of the chunk in order::

    values [2 (k, v), blocks, block_size, kv_heads, head_dim]  1 byte each
    scales [2 (k, v), blocks, kv_heads]                        float32

value = code * scale, with scale = max |x| over the block's tokens and the
head's dims / 127 (int8, rounded to nearest) or / 448 (fp8 e4m3). The
relative error of a value is thus at most half a step of its block's
largest one (int8: 1/254 of max |x|; fp8: 2^-4 of |x|, floored near 0).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence

import torch

from engine.block_pool import Holder
from engine.kv_layout import WIRE_SCALE_BYTES

from .pool_store import PoolBlockStore
from .wire import tensor_view

WIRE_DTYPES = ("int8", "fp8")
_CODE = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_BYTES = WIRE_SCALE_BYTES  # a float32 scale per (K/V, kv head) and block


def quantize(
    x: torch.Tensor,
    wire_dtype: str,
    codes_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [2, blocks, block_size, kv_heads, head_dim] -> codes (same shape, 1 byte)
    and scales [2, blocks, kv_heads] float32. ``codes_out`` and ``scratch``
    (float32, x's shape) avoid fresh allocations, which cost more than the
    arithmetic on CPU (page faults)."""
    code_dtype, code_max = _CODE[wire_dtype]
    xf = x.float()
    amax = torch.maximum(xf.amax(dim=(2, 4)), -xf.amin(dim=(2, 4)))  # [2, blocks, kv_heads]
    scales = torch.where(amax > 0, amax / code_max, torch.ones_like(amax))
    scaled = torch.mul(xf, (1.0 / scales)[:, :, None, :, None], out=scratch)
    if code_dtype is torch.int8:
        scaled.round_()
    scaled.clamp_(-code_max, code_max)  # fp8 e4m3fn has no inf: out of range would be NaN
    if codes_out is None:
        return scaled.to(code_dtype), scales
    codes_out.copy_(scaled)
    return codes_out, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``quantize`` (up to rounding), in ``dtype``."""
    values = codes.float() if scratch is None else scratch.copy_(codes)
    values.mul_(scales[:, :, None, :, None])
    return values if dtype == torch.float32 else values.to(dtype)


class _Scratch(threading.local):
    """Per-thread float32 buffers, grown as needed (transfers run in threads)."""

    def __init__(self) -> None:
        self.values = torch.empty(0)
        self.gathered = torch.empty(0)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self, name)
        n = math.prod(shape)
        if buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(n, dtype=dtype)
            setattr(self, name, buf)
        return buf[:n].view(shape)


class QuantizedBlockStore:
    """BlockSink and BlockSource whose chunks carry quantized KV."""

    def __init__(self, inner: PoolBlockStore, wire_dtype: str) -> None:
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")
        self.inner = inner
        self.wire_dtype = wire_dtype
        self.layout = dataclasses.replace(inner.layout, wire_dtype=wire_dtype)
        self.pool, self.cache, self.lock = inner.pool, inner.cache, inner.lock
        self._code_dtype = _CODE[wire_dtype][0]
        self._scratch = _Scratch()

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    def holders(self) -> list[Holder]:
        return self.inner.holders()

    def reserve(self, holder: Holder, n: int) -> list[int] | None:
        return self.inner.reserve(holder, n)

    def commit(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes | None],
        token_ids: Sequence[int],
    ) -> None:
        self.inner.commit(block_ids, block_hashes, token_ids)

    def hold_prefix(
        self, holder: Holder, block_hashes: Sequence[bytes], token_ids: Sequence[int]
    ) -> list[int]:
        return self.inner.hold_prefix(holder, block_hashes, token_ids)

    def release(self, holder: Holder, block_ids: Sequence[int] | None = None) -> None:
        self.inner.release(holder, block_ids)

    def pin(self, holder: Holder, block_ids: Sequence[int]) -> None:
        self.inner.pin(holder, block_ids)

    def pin_hashes(
        self, holder: Holder, block_hashes: Sequence[bytes]
    ) -> tuple[list[int], list[int]]:
        return self.inner.pin_hashes(holder, block_hashes)

    def read_into(
        self,
        block_ids: Sequence[int],
        layer_start: int,
        layer_end: int,
        out: memoryview,
        computed: bool = False,  # quantized on the engine's stream: ordered after its work
    ) -> None:
        idx = torch.as_tensor(block_ids, dtype=torch.long)
        views = self._views(len(block_ids), out)
        for layer, (codes_out, scales_out) in zip(
            self.cache.layers[layer_start:layer_end], views, strict=True
        ):
            shape = (2, len(block_ids), *layer.shape[2:])
            if layer.device.type == "cpu":
                gathered = self._scratch.get("gathered", shape, layer.dtype)
                torch.index_select(layer, 1, idx, out=gathered)
                scratch = self._scratch.get("values", shape, torch.float32)
                _, scales = quantize(gathered, self.wire_dtype, codes_out, scratch)
            else:  # quantize on the accelerator, move one byte per value
                codes, scales = quantize(
                    layer.index_select(1, idx.to(layer.device)), self.wire_dtype
                )
                codes_out.copy_(codes.cpu())
            scales_out.copy_(scales.cpu())

    def write(self, block_ids: Sequence[int], layer_start: int, data: memoryview) -> None:
        idx = torch.as_tensor(block_ids, dtype=torch.long)
        for i, (codes, scales) in enumerate(self._views(len(block_ids), data)):
            layer = self.cache.layers[layer_start + i]
            if layer.device.type == "cpu":
                scratch = self._scratch.get("values", codes.shape, torch.float32)
                values = dequantize(codes, scales, layer.dtype, scratch)
            else:
                values = dequantize(codes.to(layer.device), scales.to(layer.device), layer.dtype)
            layer.index_copy_(1, idx.to(layer.device), values)

    def _views(self, num_blocks: int, buf: memoryview) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(codes, scales) views of each layer's part of a payload."""
        layout = self.layout
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        values = 2 * num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim
        per_layer = num_blocks * layout.block_bytes_per_layer
        if buf.nbytes % per_layer:
            raise ValueError(f"payload of {buf.nbytes} bytes is not whole layers of {per_layer}")
        out = []
        for lo in range(0, buf.nbytes, per_layer):
            codes = tensor_view(buf[lo : lo + values], torch.uint8).view(self._code_dtype)
            scales = tensor_view(buf[lo + values : lo + per_layer], torch.float32)
            out.append((codes.view(shape), scales.view(2, num_blocks, layout.num_kv_heads)))
        return out
