"""Tensor parallelism's pieces that need no second process: each rank's
share of the weights, the settings it refuses, and the KV layout's
parallel split (tests/integration/test_tensor_parallel_engine.py runs ranks)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import pickle

import grpc
import pytest
import torch

from engine import LLM
from engine.attention import PrefillSlice, build_metadata
from engine.block_pool import BlockPool, Holder
from engine.config import EngineConfig, ModelSpec, SpeculativeConfig
from engine.kv_cache import KVCache
from engine.kv_layout import KVLayout
from engine.loader import dummy_state_dict
from engine.parallel import messages
from engine.parallel.sharding import check_splittable, rank_spec, shard_state, vocab_share
from engine.quant import QuantFormat, QuantWeight
from kv_transfer import KVBlocks, PoolBlockStore, TransferConfig, TransferError
from tests.kv_grants import granted
from tests.kv_inproc import InProcHub, InProcKVClient, InProcKVServer
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

SPEC = ModelSpec(
    architecture="Qwen2ForCausalLM",
    vocab_size=11,
    hidden_size=8,
    intermediate_size=12,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    qkv_bias=True,
    o_bias=True,
    mlp_bias=True,
    qk_norm=False,
    sliding_window=None,
    eos_token_ids=(0,),
)


class _Config:
    initializer_range = 0.02


def _state() -> dict[str, torch.Tensor]:
    return dummy_state_dict(SPEC, _Config(), seed=0)


def test_shares_put_back_together_are_the_weights():
    full = _state()
    shares = [shard_state(full, SPEC, r, 2) for r in range(2)]
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    for name in ("q_proj", "k_proj", "v_proj"):  # column-parallel: output rows
        for kind in ("weight", "bias"):
            key = f"{attn}{name}.{kind}"
            assert torch.equal(torch.cat([s[key] for s in shares]), full[key])
    for name in ("gate_proj", "up_proj"):
        key = f"{mlp}{name}.weight"
        assert torch.equal(torch.cat([s[key] for s in shares]), full[key])
    for key in (f"{attn}o_proj.weight", f"{mlp}down_proj.weight"):  # row-parallel: input columns
        assert torch.equal(torch.cat([s[key] for s in shares], dim=1), full[key])
    for key in (f"{attn}o_proj.bias", f"{mlp}down_proj.bias"):  # added once, by rank 0
        assert torch.equal(shares[0][key], full[key]) and key not in shares[1]
    embed = "model.embed_tokens.weight"
    assert all(torch.equal(s[embed], full[embed]) for s in shares)  # replicated
    head = torch.cat([s["lm_head.weight"] for s in shares])  # the tied head's vocabulary shares
    assert head.shape[0] == 2 * vocab_share(11, 2) == 12
    assert torch.equal(head[:11], full[embed]) and not head[11:].any()  # padding row


def test_int8_shares_of_o_and_down_are_cuts_of_the_whole_quantized_matrix():
    """int8's scale spans a row: o and down (split by inputs) are quantized whole
    and cut, so each rank's codes and scales are the whole matrix's."""
    spec = dataclasses.replace(SPEC, intermediate_size=128)  # 64 inputs of down a rank
    full = dummy_state_dict(spec, _Config(), seed=0)
    name = "model.layers.0.mlp.down_proj.weight"
    whole = QuantWeight.quantize(full[name], QuantFormat.INT8)
    shares = [shard_state(full, spec, r, 2, "int8")[name] for r in range(2)]
    assert all(isinstance(s, QuantWeight) and s.in_features == 64 for s in shares)
    assert torch.equal(torch.cat([s.data for s in shares], dim=1), whole.data)
    assert all(torch.equal(s.scales, whole.scales) for s in shares)
    # o's 4 inputs a rank are no whole block: cut as floats, quantized at load
    assert isinstance(
        shard_state(full, spec, 0, 2, "int8")["model.layers.0.self_attn.o_proj.weight"],
        torch.Tensor,
    )


def test_a_share_keeps_each_query_head_with_its_kv_head():
    """Rank r's query heads are those that attend with its kv heads (GQA groups stay whole)."""
    spec = rank_spec(SPEC, 2)
    assert (spec.num_heads, spec.num_kv_heads, spec.intermediate_size) == (2, 1, 6)
    assert spec.num_heads // spec.num_kv_heads == SPEC.num_heads // SPEC.num_kv_heads
    assert spec.vocab_size == 6 and not spec.tie_word_embeddings


def test_what_does_not_split_evenly_is_named():
    with pytest.raises(ValueError, match="2 kv heads do not split evenly over 4 ranks"):
        check_splittable(SPEC, 4)
    with pytest.raises(ValueError, match="12 intermediate features do not split evenly over 8"):
        check_splittable(dataclasses.replace(SPEC, num_kv_heads=8, num_heads=8), 8)


def test_tiny_model_refuses_three_ranks_before_starting_any(llama_dir):
    with pytest.raises(ValueError, match="4 attention heads do not split evenly over 3"):
        LLM(str(llama_dir), tensor_parallel_size=3, num_kv_blocks=8)


@pytest.mark.parametrize(
    "setting, named",
    [
        ({"speculative": SpeculativeConfig("ngram")}, "speculative decoding"),
        ({"cuda_graphs": True}, "cuda_graphs"),
        ({"kv_tier_memory_bytes": 1 << 20}, "a second KV tier"),
        ({"kv_transfer_dtype": "int8"}, "kv_transfer_dtype int8"),
        ({"quantization": "as_stored"}, "quantization as_stored"),
        ({"deterministic": True}, "deterministic mode"),
        ({"simulate": "tiny"}, "simulate"),
    ],
)
def test_settings_tensor_parallelism_refuses(setting, named):
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2 is not supported with {named}"):
        EngineConfig(tensor_parallel_size=2, **setting)
    EngineConfig(tensor_parallel_size=1, **setting)  # refused only with tensor parallelism


def test_layout_of_a_split_pool():
    one = KVLayout("f", "float32", num_layers=2, block_size=4, num_kv_heads=4, head_dim=8)
    two = dataclasses.replace(one, tp_size=2)
    assert two.rank_kv_heads == 2 and two.rank_block_bytes * 2 == two.block_bytes
    assert two.block_bytes == one.block_bytes  # blocks travel whole
    # kv_cache_memory_bytes is each rank's: twice the blocks in two ranks' memory
    assert KVCache.blocks_for_budget(two, 1 << 20) == 2 * KVCache.blocks_for_budget(one, 1 << 20)
    assert one.mismatch(two) is None and one.unmappable(two) is None
    assert one.mismatch(dataclasses.replace(two, head_dim=4)) == "head_dim"
    uneven = dataclasses.replace(one, tp_size=3)
    assert "splits 4 kv heads over 3 ranks" in one.unmappable(uneven)
    assert one.unmappable(dataclasses.replace(one, tp_size=0)) is not None


def _store(layout: KVLayout, seed: int) -> PoolBlockStore:
    cache = KVCache(layout, 16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for t in cache.layers:
        t.copy_(torch.randn(t.shape, generator=gen))
    return PoolBlockStore(BlockPool(16, layout.block_size), cache)


@pytest.mark.parametrize("sender_tp", [2, 3])
def test_a_push_from_another_parallel_layout_is_mapped_or_refused(sender_tp):
    """The header names the sender's split; chunks carry every head whatever it
    is, so an even split is taken as it comes and an uneven one refused at the
    header, before a block is reserved."""
    layout = KVLayout("fp", "float32", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    config = TransferConfig(chunk_bytes=1024)
    src, dst = _store(layout, 1), _store(layout, 2)
    src.layout = dataclasses.replace(layout, tp_size=sender_tp)  # what its header says
    sender = Holder("request", "r")

    async def go() -> None:
        hub = InProcHub()
        server = InProcKVServer(hub, "dst", dst, config)
        await server.start()
        ids = src.reserve(sender, 3)
        blocks = granted(config, server.address, KVBlocks("r", ids, [None] * 3, list(range(12))))
        try:
            if sender_tp == 3:
                with pytest.raises(TransferError, match="splits 2 kv heads over 3 ranks") as err:
                    await InProcKVClient(hub, config).push(server.address, src, blocks)
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            else:
                await InProcKVClient(hub, config).push(server.address, src, blocks)
                claimed = server.claim("r")
                assert torch.equal(
                    dst.cache.read_blocks(claimed.block_ids), src.cache.read_blocks(ids)
                )
                dst.release(claimed.holder)
        finally:
            src.release(sender)
            await server.stop()

    asyncio.run(go())
    assert leftover_holders(src.pool) == leftover_holders(dst.pool) == []
    assert dst.num_free == 16


class _Payload:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_step_message_round_trips_and_nothing_else_is_built():
    """What comes in on the ranks' connections is built by torch's
    weights-only loader, from tensors and the message classes alone."""
    meta = build_metadata(
        4, [[1, 2], [3]], [6, 2], [PrefillSlice(2, 3, 0, torch.tensor([5]))], list(range(5)),
        torch.device("cpu"),
    )  # fmt: skip
    sent = messages.Forward(torch.arange(5), torch.arange(5), meta)
    got = messages.decode(messages.encode(sent))
    assert torch.equal(got.input_ids, sent.input_ids)
    assert torch.equal(got.meta.decode_groups[0].block_tables, meta.decode_groups[0].block_tables)
    assert torch.equal(got.meta.prefills[0].block_table, torch.tensor([5]))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        buf = io.BytesIO()
        torch.save(_Payload(), buf, _use_new_zipfile_serialization=False)
        messages.decode(buf.getvalue())
