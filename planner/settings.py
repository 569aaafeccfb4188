"""The model's settings for a serve config: the same token budgets, block
size, KV pools, routing rules, and the bytes a transfer really moves."""

from __future__ import annotations

from dataclasses import dataclass

from planner.simulator import SystemConfig

# The simulated engine's KV: 1 layer x (K, V) x 1 head x 4 floats (engine/simulated.py).
SIMULATED_KV_BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class Overheads:
    """Fixed costs on the request path outside the engine steps (seconds):
    the router's Ray call to a worker, a KV push's handshake and commit,
    the output stream to the client; the transfer's bandwidth."""

    rpc_s: float = 0.002
    push_s: float = 0.004
    stream_s: float = 0.001
    bandwidth_Bps: float = 1e9


def system_for(
    config,
    kv_bytes_per_token: int,
    *,
    simulated: bool,
    overheads: Overheads | None = None,
) -> SystemConfig:
    """``config``: a router.config.ServeConfig. ``kv_bytes_per_token``: the
    profiled model's (it sizes the pools in blocks, as the engine does);
    ``simulated``: the workers run the simulated engine, whose transfers
    move its own small KV."""
    e, r = config.engine, config.routing
    o = overheads or Overheads()
    blocks = max(1, (e.kv_cache_memory_mb << 20) // (kv_bytes_per_token * e.block_size))
    return SystemConfig(
        num_prefill=max(1, config.pools.prefill),
        num_decode=config.pools.decode,
        prefill_token_budget=e.max_num_batched_tokens,
        decode_token_budget=e.max_num_batched_tokens,
        max_decode_seqs=e.max_num_seqs,
        max_prefill_seqs=e.max_num_seqs,
        block_size=e.block_size,
        prefill_kv_blocks=blocks,
        decode_kv_blocks=blocks,
        kv_bytes_per_token=SIMULATED_KV_BYTES_PER_TOKEN if simulated else kv_bytes_per_token,
        kv_bandwidth_Bps=o.bandwidth_Bps,
        kv_latency_s=o.push_s,
        rpc_latency_s=o.rpc_s,
        stream_latency_s=o.stream_s,
        prefix_routing=r.prefix_routing,
        local_prefill_tokens=r.local_prefill_tokens,
    )
