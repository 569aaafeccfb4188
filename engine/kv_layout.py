"""The layout of a pool's KV blocks: what two pools must agree on before
blocks move between them. Torch-free (the KV transfer header carries it).

A tensor-parallel pool (``tp_size`` ranks) splits the kv heads over its
ranks, contiguously and evenly: rank r holds heads
[r * num_kv_heads / tp_size, (r + 1) * num_kv_heads / tp_size). Blocks travel
with all their heads in order whatever either side's ``tp_size``, so two pools
of different sizes exchange blocks as long as each split is such a one
(``unmappable``)."""

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
    # Ranks the kv heads are split over (tensor parallelism); 1: one rank holds all.
    tp_size: int = 1

    @property
    def rank_kv_heads(self) -> int:
        """Kv heads each rank's cache holds."""
        return self.num_kv_heads // self.tp_size

    @property
    def rank_block_bytes(self) -> int:
        """Bytes of one block, every layer, in one rank's cache."""
        values = 2 * self.block_size * self.rank_kv_heads * self.head_dim * self.num_layers
        return values * ITEMSIZE[self.dtype]

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
        """Name of the first field that differs from ``other``, else None; not
        ``tp_size``, which a transfer maps (see ``unmappable``)."""
        for name in self.__dataclass_fields__:
            if name != "tp_size" and getattr(self, name) != getattr(other, name):
                return name
        return None

    def unmappable(self, other: KVLayout) -> str | None:
        """Why blocks of ``other``'s parallel layout cannot be mapped onto this
        one's ranks (after ``mismatch`` found nothing), else None."""
        for side, layout in (("ours", self), ("theirs", other)):
            tp, heads = layout.tp_size, layout.num_kv_heads
            if tp < 1 or heads % tp:
                return (
                    f"parallel layout ({side}) splits {heads} kv heads over {tp} ranks: "
                    "only an even split (each rank a contiguous share) can be resharded"
                )
        return None
