"""The pieces of the GPU path that run anywhere: device selection, the
fixed-shape decode runner (eager on the host, the same padding a CUDA graph
replays), low-precision KV through the transfer store; and, where a GPU is
visible, the same on it."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.block_pool import BlockPool, Held, Holder
from engine.device import host_buffer, resolve_device
from engine.kv_cache import KVCache, KVLayout
from engine.llm_engine import SCRATCH
from kv_transfer import PoolBlockStore
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

CUDA = torch.cuda.is_available()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    # Lengths spread over several decode groups and table widths.
    return [torch.randint(10, 5000, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 70, 33)]


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):  # staggered ends: the batch shrinks
        params = SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_auto_device_is_cuda_only_where_a_gpu_is_visible():
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not CUDA:
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_host_buffer_is_writable_and_sized():
    buf = host_buffer(1000, torch.device("cpu"))
    buf[:3] = b"abc"
    assert buf.nbytes == 1000 and bytes(buf[:3]) == b"abc"


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
)
def test_fixed_shape_decode_matches_the_dynamic_path(llama_dir, device):
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=64, max_num_seqs=8, device=device)
    reference = _generate(LLMEngine(config), _prompts())
    engine = LLMEngine(config)
    engine.enable_decode_graphs(use_graphs=device == "cuda")
    runner = engine.decode_graphs
    assert runner.batch_sizes == (1, 2, 4, 8)
    batches: list[int] = []  # sequences in each step the fixed-shape runner ran
    fixed_forward = runner.forward

    def counting_forward(input_ids, *args):
        batches.append(len(input_ids))
        return fixed_forward(input_ids, *args)

    runner.forward = counting_forward
    start = engine.block_pool.num_free
    assert _generate(engine, _prompts()) == reference
    assert leftover_holders(engine.block_pool, own=[SCRATCH]) == []
    assert engine.block_pool.held_by(SCRATCH) == [engine.decode_graphs.scratch_block]
    assert engine.block_pool.num_free == start
    assert 6 in batches  # six sequences, padded to eight
    assert {1, 3, 5} <= set(batches)  # and smaller, padded batches as requests finished
    assert (engine.decode_graphs.num_graphs > 0) == (device == "cuda")


def test_fixed_shape_decode_refuses_batches_beyond_its_largest():
    runner_cls = __import__("engine.cuda_graphs", fromlist=["DecodeGraphRunner"])
    runner = runner_cls.DecodeGraphRunner(None, _cache("float32", "cpu"), 4, 8, 6, 0, False)
    assert runner.batch_sizes == (1, 2, 4, 6)
    assert runner.supports(6) and not runner.supports(7)


def _cache(dtype: str, device: str, num_blocks: int = 8) -> KVCache:
    layout = KVLayout("fp", dtype, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
    return KVCache(layout, num_blocks, torch.device(device))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
)
def test_low_precision_blocks_round_trip_through_staging(dtype, device):
    src_cache, dst_cache = _cache(dtype, device), _cache(dtype, device)
    for t in src_cache.layers:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    src = PoolBlockStore(BlockPool(8, 4), src_cache)
    dst = PoolBlockStore(BlockPool(8, 4), dst_cache)
    blocks = [5, 1, 6]
    size = 3 * len(blocks) * src.layout.block_bytes_per_layer
    staging = src.staging_buffer(size)  # pinned host memory for a GPU cache
    src.read_into(blocks, 0, 3, staging)
    lease = Holder("lease", "recv:r#0")
    targets = dst.reserve(lease, 3)
    dst.write(targets, 0, staging)
    assert torch.equal(src_cache.read_blocks(blocks), dst_cache.read_blocks(targets))
    dst.release(lease)
    assert dst.holders() == []
    if device == "cuda":
        assert torch.frombuffer(staging, dtype=torch.uint8).is_pinned()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_engine_hands_its_kv_to_another_through_the_store(llama_dir, dtype):
    """Prefill on one engine, blocks moved as a transfer moves them (read into
    a staging buffer, written into reserved blocks), decode on another: the
    same tokens as one engine alone, in bf16 and fp16."""
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=64, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = _prompts()[2]
    prefill, decode = LLMEngine(config), LLMEngine(config)
    start = (prefill.block_pool.num_free, decode.block_pool.num_free)
    prefill.add_request("alone", prompt, params)
    alone = []
    while prefill.has_unfinished():
        alone += [t for o in prefill.step() for t in o.new_token_ids]

    prefill.add_request("r", prompt, params, prefill_only=True)
    first = [t for o in prefill.step() for t in o.new_token_ids]
    export = prefill.export_kv("r", with_data=False)
    src = PoolBlockStore(prefill.block_pool, prefill.kv_cache)
    dst = PoolBlockStore(decode.block_pool, decode.kv_cache)
    n, layers = len(export.block_ids), prefill.kv_layout.num_layers
    staging = src.staging_buffer(layers * n * src.layout.block_bytes_per_layer)
    src.read_into(export.block_ids, 0, layers, staging)
    prefill.release("r")
    lease = Holder("lease", "recv:r#0")
    blocks = dst.reserve(lease, n)
    dst.write(blocks, 0, staging)
    decode.add_prefilled_request("r", prompt, first, params, [Held(lease, blocks)])
    rest = []
    while decode.has_unfinished():
        rest += [t for o in decode.step() for t in o.new_token_ids]
    assert first + rest == alone
    assert leftover_holders(prefill.block_pool) == leftover_holders(decode.block_pool) == []
    assert (prefill.block_pool.num_free, decode.block_pool.num_free) == start
