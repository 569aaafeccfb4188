"""Quantized KV on the wire: codec error bounds, the store's payload, and
whole transfers (in-process and gRPC with the data channel) that land
dequantized blocks and leave both pools as they were."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from engine.block_pool import BlockPool, Holder
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import (
    GrpcKVClient,
    GrpcKVServer,
    KVBlocks,
    PoolBlockStore,
    TransferConfig,
    TransferError,
)
from kv_transfer.quantized import QuantizedBlockStore, dequantize, quantize
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


async def _push(client, server, src, dst, n: int):
    free = (src.num_free, dst.num_free)
    ids = src.reserve(SENDER, n)
    result = await client.push(server.address, src, KVBlocks("r", ids, [None] * n, []))
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
            result, x, y = await _push(client, server, src, dst, 5)
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
            await client.push(server.address, src, KVBlocks("r", ids, [None, None], []))
        src.release(SENDER)
        await server.stop()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "wire_dtype" in err.value.message
        assert src.holders() == dst.holders() == []
        assert (src.num_free, dst.num_free) == free

    asyncio.run(go())
