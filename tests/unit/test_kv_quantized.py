"""Quantized KV on the wire: codec error bounds, the store's payload, and
whole transfers (in-process and gRPC with the data channel) that land
dequantized blocks and leave both pools as they were."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from engine.block_pool import BlockPool, Holder
from engine.hashing import hash_blocks, root_hash
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import (
    CommittedPush,
    GrpcKVClient,
    GrpcKVServer,
    KVBlocks,
    PoolBlockStore,
    TransferConfig,
    TransferError,
)
from kv_transfer.chain import cache_salt_for
from kv_transfer.quantized import QuantizedBlockStore, dequantize, quantize
from tests.kv_grants import granted
from tests.kv_inproc import InProcHub, InProcKVClient, InProcKVServer

pytestmark = pytest.mark.unit

LAYOUT = KVLayout("fp", "float32", 3, 4, 2, 8)


def _kv(seed: int, blocks: int = 6) -> torch.Tensor:
    """[2, blocks, block_size, kv_heads, head_dim] with magnitudes that vary by
    block and head (as real keys do), a zero block and a lone outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, blocks, 4, 2, 8, generator=gen)
    x *= torch.logspace(-3, 2, blocks)[None, :, None, None, None]
    x[:, 1] = 0.0
    x[0, 2, 3, 1, 5] = 50.0
    return x


@pytest.mark.parametrize("seed", range(3))
def test_int8_error_is_at_most_half_a_step_of_its_block_and_head(seed):
    x = _kv(seed)
    codes, scales = quantize(x, "int8")
    assert codes.dtype == torch.int8 and scales.shape == (2, 6, 2)
    y = dequantize(codes, scales, torch.float32)
    step = x.abs().amax(dim=(2, 4)) / 127  # [2, blocks, heads]
    bound = step[:, :, None, :, None] * (0.5 + 1e-4)
    assert ((y - x).abs() <= bound).all()
    assert torch.equal(y[:, 1], x[:, 1])  # zeros stay exact
    assert torch.equal(
        codes.abs().amax(dim=(2, 4))[x.abs().amax(dim=(2, 4)) > 0],
        torch.full((int((x.abs().amax(dim=(2, 4)) > 0).sum()),), 127, dtype=torch.int8),
    )


@pytest.mark.parametrize("seed", range(3))
def test_fp8_error_is_relative(seed):
    x = _kv(seed)
    codes, scales = quantize(x, "fp8")
    y = dequantize(codes, scales, torch.float32)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 of the scale.
    bound = x.abs() * 2**-4 + scales[:, :, None, :, None] * 2**-9
    assert ((y - x).abs() <= bound * (1 + 1e-5)).all()


def _store(seed: int, wire: str | None, num_blocks: int = 16, dtype: str = "float32"):
    layout = KVLayout("fp", dtype, 3, 4, 2, 8)
    cache = KVCache(layout, num_blocks, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for t in cache.layers:
        t.copy_(torch.randn(t.shape, generator=gen) * 3)
    store = PoolBlockStore(BlockPool(num_blocks, 4), cache)
    return QuantizedBlockStore(store, wire) if wire else store


def test_store_payload_is_a_quarter_and_round_trips():
    src, dst = _store(1, "int8"), _store(2, "int8")
    ids = [3, 4, 9]
    per_layer = src.layout.block_bytes_per_layer
    assert per_layer == 2 * 4 * 2 * 8 + 2 * 2 * 4  # codes + float32 scales
    assert per_layer * 4 < LAYOUT.block_bytes_per_layer * 1.2
    payload = memoryview(bytearray(2 * len(ids) * per_layer))
    src.read_into(ids, 1, 3, payload)
    dst.write([0, 1, 2], 1, memoryview(bytes(payload)))  # as received: read-only
    for layer in (1, 2):
        x = src.cache.layers[layer][:, ids]
        y = dst.cache.layers[layer][:, :3]
        step = x.abs().amax(dim=(2, 4)) / 127
        assert ((y - x).abs() <= step[:, :, None, :, None] * (0.5 + 1e-4)).all()
    assert torch.equal(dst.cache.layers[0][:, :3], _store(2, None).cache.layers[0][:, :3])


def test_bfloat16_pool_round_trips_through_fp8():
    src, dst = _store(1, "fp8", dtype="bfloat16"), _store(2, "fp8", dtype="bfloat16")
    payload = memoryview(bytearray(3 * 2 * src.layout.block_bytes_per_layer))
    src.read_into([5, 6], 0, 3, payload)
    dst.write([7, 8], 0, payload)
    x, y = src.cache.layers[2][:, [5, 6]].float(), dst.cache.layers[2][:, [7, 8]].float()
    assert ((y - x).abs() <= x.abs() * 0.07 + 0.01).all()


SENDER = Holder("request", "r")


def _blocks(server, ids: list[int], config: TransferConfig | None = None) -> KVBlocks:
    tokens = list(range(100, 100 + len(ids) * LAYOUT.block_size))
    blocks = KVBlocks("r", ids, [None] * len(ids), tokens)
    # The grant is minted under the server's own cluster secret (a default
    # TransferConfig holds a random one of its own).
    return granted(config or server.service.config, server.address, blocks)


async def _push(client, server, src, dst, n: int, config: TransferConfig):
    free = (src.num_free, dst.num_free)
    ids = src.reserve(SENDER, n)
    result = await client.push(server.address, src, _blocks(server, ids, config))
    claimed = server.claim("r")
    x, y = src.cache.read_blocks(ids), dst.cache.read_blocks(claimed.block_ids)
    dst.release(claimed.holder)
    src.release(SENDER)
    assert src.holders() == dst.holders() == []
    assert (src.num_free, dst.num_free) == free
    return result, x, y


@pytest.mark.parametrize("mover", ["inproc", "grpc"])
def test_quantized_push_lands_dequantized_blocks(mover):
    async def go():
        config = TransferConfig(chunk_bytes=700)  # several chunks
        src, dst = _store(1, "int8"), _store(2, "int8")
        if mover == "inproc":
            hub = InProcHub()
            server, client = InProcKVServer(hub, "d", dst, config), InProcKVClient(hub, config)
        else:
            server, client = GrpcKVServer(dst, config), GrpcKVClient(config)
        await server.start()
        try:
            result, x, y = await _push(client, server, src, dst, 5, config)
        finally:
            await client.close()
            await server.stop()
        assert result.bytes_sent == 5 * src.layout.block_bytes
        assert result.bytes_sent < 5 * LAYOUT.block_bytes / 3.5
        step = x.abs().amax(dim=(3, 5)) / 127  # [layers, 2, blocks, heads]
        assert ((y - x).abs() <= step[:, :, :, None, :, None] * (0.5 + 1e-4)).all()

    asyncio.run(go())


@pytest.mark.parametrize(("src_wire", "dst_wire"), [("int8", None), (None, "fp8")])
def test_a_pool_with_another_wire_encoding_refuses_at_the_header(src_wire, dst_wire):
    async def go():
        src, dst = _store(1, src_wire), _store(2, dst_wire)
        hub = InProcHub()
        server, client = InProcKVServer(hub, "d", dst), InProcKVClient(hub)
        await server.start()
        free = (src.num_free, dst.num_free)
        ids = src.reserve(SENDER, 2)
        with pytest.raises(TransferError) as err:
            await client.push(server.address, src, _blocks(server, ids))
        src.release(SENDER)
        await server.stop()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "wire_dtype" in err.value.message
        assert src.holders() == dst.holders() == []
        assert (src.num_free, dst.num_free) == free

    asyncio.run(go())


class _Keep:
    """A PushHandler that keeps the committed pushes."""

    def __init__(self) -> None:
        self.pushes: list[CommittedPush] = []

    def check(self, request_id: str, decode_start: bytes) -> None:
        return None

    def committed(self, push: CommittedPush) -> None:
        self.pushes.append(push)


@pytest.mark.parametrize("wire_dtype", [None, "int8", "fp8"])
def test_quantized_wire_kv_is_never_an_exact_prefix_entry(wire_dtype):
    """Blocks that came quantized are indexed under a salt of their own: a
    full-precision request's lookup (plain hashes) finds none of them, one
    whose KV came the same way finds them all. Full precision: plain hashes."""

    async def go():
        src, dst, keep = _store(1, wire_dtype), _store(2, wire_dtype), _Keep()
        hub = InProcHub()
        server = InProcKVServer(hub, "d", dst, handler=keep)
        client = InProcKVClient(hub)
        await server.start()
        free = (src.num_free, dst.num_free)
        ids = src.reserve(SENDER, 3)
        blocks = dataclasses.replace(_blocks(server, ids), next_token_ids=[9])
        await client.push(server.address, src, blocks)
        await server.stop()
        [push] = keep.pushes
        bs = LAYOUT.block_size
        root = root_hash(LAYOUT.model_fingerprint, bs)
        plain = hash_blocks(blocks.token_ids, bs, root)
        salted = hash_blocks(blocks.token_ids, bs, root, cache_salt_for(wire_dtype or "", b""))
        found_plain = [dst.pool.block_for_hash(h) for h in plain]
        found_salted = [dst.pool.block_for_hash(h) for h in salted]
        assert push.cache_salt == cache_salt_for(wire_dtype or "", b"")
        if wire_dtype is None:
            assert found_plain == push.blocks.block_ids and salted == plain
        else:
            assert found_plain == [None, None, None]
            assert found_salted == push.blocks.block_ids
        dst.release(push.blocks.holder)
        src.release(SENDER)
        assert src.holders() == dst.holders() == []
        assert (src.num_free, dst.num_free) == free

    asyncio.run(go())
