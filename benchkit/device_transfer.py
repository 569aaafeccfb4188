"""A KV push between two pools on one device through the gRPC mover on
loopback, against a plain device -> host -> device copy (bench/gpu_check.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from benchkit.kv_peer import push_grant
from engine.block_pool import BlockPool, Holder
from engine.config import ModelSpec
from engine.device import synchronize
from engine.kv_cache import KVCache
from kv_transfer import GrpcKVClient, GrpcKVServer, KVBlocks, PoolBlockStore, TransferConfig


async def _push(src: PoolBlockStore, dst: PoolBlockStore, blocks: list[int], reps: int):
    transfer = TransferConfig()  # one random cluster secret for both ends
    server = GrpcKVServer(dst, transfer, host="127.0.0.1", port=0)
    await server.start()
    client = GrpcKVClient(transfer)
    rates = []
    try:
        for i in range(reps + 1):  # the first warms up
            # Tokens of each push's own: the receiver holds no prefix of it.
            tokens = [(i * 7919 + t) % 30000 for t in range(len(blocks) * dst.layout.block_size)]
            grant = push_grant(server.service.config, server.address, f"r{i}")
            request = KVBlocks(f"r{i}", blocks, [None] * len(blocks), tokens, grant=grant)
            start = time.perf_counter()
            result = await client.push(server.address, src, request)
            rates.append(result.bytes_sent / (time.perf_counter() - start))
            dst.release(server.claim(f"r{i}").holder)
    finally:
        await client.close()
        await server.stop()
    return rates[1:]


def transfer_check(ckpt: Path, device, dtype: str, mib: int, reps: int) -> dict:
    from engine.kv_cache import KVLayout
    from engine.loader import load_hf_config

    spec = ModelSpec.from_hf_config(load_hf_config(ckpt))
    layout = KVLayout("gpu-check", dtype, spec.num_layers, 16, spec.num_kv_heads, spec.head_dim)
    n = max(1, (mib << 20) // layout.block_bytes)
    src = PoolBlockStore(BlockPool(n, 16), KVCache(layout, n, device))
    dst = PoolBlockStore(BlockPool(n, 16), KVCache(layout, n, device))
    for t in src.cache.layers:
        t.normal_()
    bench = Holder("lease", "gpu-check")
    blocks = src.reserve(bench, n)
    rates = asyncio.run(_push(src, dst, blocks, reps))
    # Baseline: the same bytes device -> host -> device with plain torch copies.
    data = src.cache.read_blocks(blocks)
    synchronize(device)
    start = time.perf_counter()
    dst.cache.write_blocks(blocks, data.cpu())
    synchronize(device)
    copy_rate = data.numel() * data.element_size() / (time.perf_counter() - start)
    src.release(bench)
    best = max(rates)
    return {
        "bytes": n * layout.block_bytes,
        "push_gb_s": round(best / 1e9, 3),
        "copy_gb_s": round(copy_rate / 1e9, 3),
        "ratio": round(best / copy_rate, 3),
    }
