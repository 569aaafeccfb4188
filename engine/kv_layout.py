"""The layout of a pool's KV blocks: what two pools must agree on before
blocks move between them. Torch-free (the KV transfer header carries it)."""

from __future__ import annotations

from dataclasses import dataclass

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # the cache dtypes EngineConfig allows
WIRE_SCALE_BYTES = 4  # a quantized wire format's float32 scale


@dataclass(frozen=True)
class KVLayout:
    """What two pools must agree on before KV blocks can move between them."""

    model_fingerprint: str
    dtype: str  # torch dtype name, e.g. "float32"
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    # How blocks travel between pools: "" as dtype, else a one-byte encoding
    # (int8 or fp8, see kv_transfer/quantized.py). A pool's own cache has "".
    wire_dtype: str = ""

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of K plus V of one block in one layer (on the wire, for a wire_dtype)."""
        values = 2 * self.block_size * self.num_kv_heads * self.head_dim
        if self.wire_dtype:  # one byte per value, a float32 scale per (K/V, kv head)
            return values + 2 * self.num_kv_heads * WIRE_SCALE_BYTES
        return values * ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.block_bytes_per_layer * self.num_layers

    def mismatch(self, other: KVLayout) -> str | None:
        """Name of the first field that differs from ``other``, else None."""
        for name in self.__dataclass_fields__:
            if getattr(self, name) != getattr(other, name):
                return name
        return None
