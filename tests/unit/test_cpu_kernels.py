"""The fused CPU kernels (engine/kernels/) against the PyTorch path they replace."""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

import engine.kernels as kernels
from engine import LLM
from engine.attention import PrefillSlice, build_metadata, paged_attention
from engine.kv_cache import KVCache, KVLayout
from engine.models.llama import _rms_norm, _rotate
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the engine runs its PyTorch path", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    return kernels.cpu_ops(required=True)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,width", [(1, 256), (7, 576), (300, 64)])
def test_rms_norm_and_fused_residual(ops, rows, width):
    g = _gen()
    x, delta = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    w = torch.randn(width, generator=g)
    torch.testing.assert_close(
        ops.rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6
    )
    residual = x.clone()
    out = ops.add_rms_norm(residual, delta, w, 1e-5)
    assert torch.equal(residual, x + delta)  # updated in place, exactly
    torch.testing.assert_close(out, _rms_norm(x + delta, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows(ops):
    wide = torch.randn(5, 300, generator=_gen(1))
    x, w = wide[:, :256], torch.randn(256, generator=_gen(2))
    torch.testing.assert_close(
        ops.rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6
    )


def test_silu_mul(ops):
    gate_up = torch.randn(9, 2 * 688, generator=_gen()) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def _layout(kv_heads: int, head_dim: int, block_size: int = 16) -> KVLayout:
    return KVLayout("test", "float32", 1, block_size, kv_heads, head_dim)


@pytest.mark.parametrize("rows", [0, 1, 5, 12, 13, 40, 601])  # 601: several row blocks
@pytest.mark.parametrize("k,n", [(256, 512), (64, 33), (100, 31), (576, 1000)])
def test_linear_equals_mm_over_packed_panels(ops, rows, k, n):
    g = _gen(rows + n)
    x, w, bias = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g), torch.randn(n)
    packed = kernels.PackedWeight.pack(w)
    assert packed.panels.shape == (-(-n // kernels.PANEL_WIDTH), k, kernels.PANEL_WIDTH)
    assert ops.PANEL_WIDTH == kernels.PANEL_WIDTH
    unpacked = packed.panels.transpose(0, 1).reshape(k, -1)[:, :n]
    assert torch.equal(unpacked, w)
    tol = {"rtol": 1e-5, "atol": 1e-5 * math.sqrt(k)}  # only the summation order differs
    torch.testing.assert_close(ops.linear(x, packed.panels, n), x @ w, **tol)
    torch.testing.assert_close(ops.linear(x, packed.panels, n, bias), x @ w + bias, **tol)


def test_linear_rows_do_not_depend_on_the_batch(ops):
    """Rows go through different tiles (a full group of rows or the rest),
    yet each output is the same in-order sum: a sequence's logits are the
    same bits whatever batch it decodes in."""
    g = _gen(7)
    x, w, bias = (
        torch.randn(23, 256, generator=g),
        torch.randn(256, 100, generator=g),
        torch.randn(100),
    )
    packed = kernels.PackedWeight.pack(w)
    whole = ops.linear(x, packed.panels, 100, bias)
    for rows in (slice(0, 1), slice(5, 9), slice(11, 23)):
        assert torch.equal(ops.linear(x[rows], packed.panels, 100, bias), whole[rows])


@pytest.mark.parametrize("rows", [0, 1, 5, 12, 13, 40, 601])
@pytest.mark.parametrize("k,inter", [(256, 688), (64, 33), (100, 32), (576, 500)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_silu_mul_is_the_same_bits_as_linear_then_silu_mul(ops, rows, k, inter, with_bias):
    g = _gen(rows + inter)
    x, w = torch.randn(rows, k, generator=g), torch.randn(k, 2 * inter, generator=g)
    bias = torch.randn(2 * inter, generator=g) if with_bias else None
    fused = kernels.PackedWeight.pack_gate_up(w)
    assert fused.out_features == inter
    got = ops.linear_silu_mul(x, fused.panels, inter, kernels.PackedWeight.pad_gate_up_bias(bias))
    plain = ops.silu_mul(ops.linear(x, kernels.PackedWeight.pack(w).panels, 2 * inter, bias))
    assert torch.equal(got, plain)
    if rows:
        gate, up = (x @ w + (0 if bias is None else bias)).chunk(2, dim=-1)
        torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-4, atol=1e-4 * math.sqrt(k))


def test_linear_silu_mul_refuses_a_plain_packing(ops):
    w = torch.randn(64, 2 * 40, generator=_gen(5))
    with pytest.raises(RuntimeError, match="panels must be"):
        ops.linear_silu_mul(torch.randn(3, 64), kernels.PackedWeight.pack(w).panels, 40)


def test_linear_rows_are_the_same_bits_in_a_prefill_sized_batch(ops):
    """A batch of thousands of rows goes over the panels block by block (the
    blocks, the tiles and the rows left over all differ from a small batch's)."""
    g = _gen(8)
    w, bias = torch.randn(256, 1376, generator=g), torch.randn(1376)
    x = torch.randn(2048 + 7, 256, generator=g)
    packed = kernels.PackedWeight.pack(w)
    whole = ops.linear(x, packed.panels, 1376, bias)
    for rows in (slice(0, 5), slice(250, 262), slice(1000, 1013), slice(2040, 2055)):
        assert torch.equal(ops.linear(x[rows], packed.panels, 1376, bias), whole[rows])


def test_linear_reads_strided_rows_and_refuses_mismatches(ops):
    wide = torch.randn(7, 300, generator=_gen(3))
    x, w = wide[:, :256], torch.randn(256, 70, generator=_gen(4))
    packed = kernels.PackedWeight.pack(w)
    torch.testing.assert_close(ops.linear(x, packed.panels, 70), x @ w, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="x has 255 columns"):
        ops.linear(wide[:, :255], packed.panels, 70)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear(x, packed.panels, 100)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.linear(x, packed.panels, 70, torch.zeros(69))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.linear(x, packed.panels.transpose(1, 2), 70)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 32), (4, 4, 64), (6, 2, 16)])
def test_rope_store_kv(ops, heads, kv_heads, head_dim):
    g, n, max_len = _gen(), 5, 64
    cache = KVCache(_layout(kv_heads, head_dim), 8, torch.device("cpu"))
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g)
    cos, sin = (
        torch.randn(max_len, head_dim, generator=g),
        torch.randn(max_len, head_dim, generator=g),
    )
    positions = torch.tensor([0, 3, 17, 40, 63])
    slots = torch.tensor([5, 99, 16, 0, 127])

    qk = qkv[:, : (heads + kv_heads) * head_dim].reshape(n, heads + kv_heads, head_dim)
    expected = _rotate(qk, cos[positions][:, None, :], sin[positions][:, None, :])
    values = qkv[:, (heads + kv_heads) * head_dim :].reshape(n, kv_heads, head_dim).clone()

    fused = qkv.clone()
    ops.rope_store_kv(fused, cos, sin, positions, slots, cache.layers[0], heads, kv_heads)
    rotated = fused[:, : (heads + kv_heads) * head_dim].reshape(n, heads + kv_heads, head_dim)
    assert torch.equal(rotated, expected)  # the same two products and one sum per value
    flat = cache.flat(0)
    assert torch.equal(flat[0][slots], expected[:, heads:])
    assert torch.equal(flat[1][slots], values)


def test_rope_store_kv_refuses_bad_slots(ops):
    cache = KVCache(_layout(1, 8), 2, torch.device("cpu"))
    qkv, table = torch.zeros(1, 3 * 8), torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        ops.rope_store_kv(
            qkv, table, table, torch.tensor([0]), torch.tensor([32]), cache.layers[0], 1, 1
        )
    with pytest.raises(RuntimeError, match="position 4 out of range"):
        ops.rope_store_kv(
            qkv, table, table, torch.tensor([4]), torch.tensor([0]), cache.layers[0], 1, 1
        )


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 32), (9, 3, 64), (4, 4, 16)])
def test_paged_decode_attention_equals_the_pytorch_path(ops, heads, kv_heads, head_dim):
    """Decode rows of very different lengths, tables padded, blocks shared and scattered."""
    g, bs, num_blocks = _gen(3), 16, 40
    cache = KVCache(_layout(kv_heads, head_dim, bs), num_blocks, torch.device("cpu"))
    cache.layers[0].copy_(torch.randn(cache.layers[0].shape, generator=g))
    lens = [1, 16, 17, 90, 200]  # shortest first, as the engine sorts them
    tables = [torch.randperm(num_blocks, generator=g)[: math.ceil(n / bs)].tolist() for n in lens]
    tables[1][0] = tables[2][0]  # a shared prefix block
    b = len(lens)
    q = torch.randn(b, heads, head_dim, generator=g)
    k, v = (
        torch.randn(b, kv_heads, head_dim, generator=g),
        torch.randn(b, kv_heads, head_dim, generator=g),
    )
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]

    reference_meta = build_metadata(bs, tables, lens, [], slots, torch.device("cpu"))
    expected = paged_attention(q, k, v, cache, 0, reference_meta, head_dim**-0.5)
    fused_meta = build_metadata(bs, tables, lens, [], slots, torch.device("cpu"), fused=True)
    got = ops.paged_decode_attention(
        q, cache.layers[0], fused_meta.decode_tables, fused_meta.decode_lens, head_dim**-0.5
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_paged_decode_attention_refuses_out_of_range_tables(ops):
    cache = KVCache(_layout(1, 8), 2, torch.device("cpu"))
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_decode_attention(q, cache.layers[0], torch.tensor([[2]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="context length 17 out of range"):
        ops.paged_decode_attention(q, cache.layers[0], torch.tensor([[0]]), torch.tensor([17]), 1.0)


def _slots(table: torch.Tensor, context: int, tokens: int, block_size: int) -> list[int]:
    """The cache slots of a prompt's new tokens (the PyTorch path stores them there)."""
    positions = range(context, context + tokens)
    return [int(table[p // block_size]) * block_size + p % block_size for p in positions]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,context,tokens",
    [
        (8, 4, 32, 16, 0, 256),  # the default model's shape, a whole prompt
        (8, 4, 32, 16, 37, 100),  # a chunk after a context (cached prefix, earlier chunk)
        (9, 3, 64, 16, 0, 33),
        (4, 4, 16, 7, 20, 50),  # blocks not a multiple of the key tiles
        (8, 2, 128, 16, 5, 70),
        (6, 3, 24, 16, 3, 40),  # a head size the kernel has no fixed-size path for
        (8, 4, 32, 16, 0, 1),
        (8, 4, 32, 16, 300, 17),
    ],
)
def test_paged_prefill_attention_equals_sdpa(
    ops, heads, kv_heads, head_dim, block_size, context, tokens
):
    """Causal attention of a prompt's rows over a scattered paged context
    equals the PyTorch path (SDPA over the gathered blocks)."""
    g = _gen(4)
    used = math.ceil((context + tokens) / block_size)
    num_blocks = used + 5
    cache = KVCache(_layout(kv_heads, head_dim, block_size), num_blocks, torch.device("cpu"))
    cache.layers[0].copy_(torch.randn(cache.layers[0].shape, generator=g))
    table = torch.randperm(num_blocks, generator=g)[:used]
    q = torch.randn(tokens, heads, head_dim, generator=g)
    new = cache.layers[0].index_select(1, table).flatten(1, 2)[:, context : context + tokens]
    meta = build_metadata(
        block_size,
        [],
        [],
        [PrefillSlice(0, tokens, context, table)],
        _slots(table, context, tokens, block_size),
        torch.device("cpu"),
    )
    expected = paged_attention(q, new[0], new[1], cache, 0, meta, head_dim**-0.5)
    got = ops.paged_prefill_attention(q, cache.layers[0], table, context, head_dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_paged_attention_sends_prompts_to_the_kernel_up_to_its_limit(ops, monkeypatch):
    """With the kernels, a prompt of up to FUSED_PREFILL_MAX_KEYS keys goes to
    paged_prefill_attention, a longer one to SDPA; both give the same rows."""
    import engine.attention as attention

    g = _gen(6)
    cache = KVCache(_layout(2, 16), 8, torch.device("cpu"))
    cache.layers[0].copy_(torch.randn(cache.layers[0].shape, generator=g))
    table = torch.tensor([5, 1, 6])
    q = torch.randn(40, 4, 16, generator=g)
    new = cache.layers[0].index_select(1, table).flatten(1, 2)[:, :40]
    slots = _slots(table, 0, 40, 16)
    meta = build_metadata(16, [], [], [PrefillSlice(0, 40, 0, table)], slots, torch.device("cpu"))
    calls = []

    class Counting:
        def paged_prefill_attention(self, *args):
            calls.append(args[3])
            return ops.paged_prefill_attention(*args)

    def run():
        return paged_attention(q, new[0], new[1], cache, 0, meta, 0.25, ops=Counting())

    fused = run()
    assert calls == [0]
    monkeypatch.setattr(attention, "FUSED_PREFILL_MAX_KEYS", 39)
    reference = run()
    assert calls == [0]  # over the limit: SDPA
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)


def test_paged_prefill_attention_refuses_bad_tables(ops):
    cache = KVCache(_layout(1, 8), 2, torch.device("cpu"))
    q = torch.zeros(3, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_prefill_attention(q, cache.layers[0], torch.tensor([2]), 0, 1.0)
    with pytest.raises(RuntimeError, match="2 needed"):
        ops.paged_prefill_attention(q, cache.layers[0], torch.tensor([0]), 14, 1.0)


def test_argmax_rows(ops):
    x = torch.randn(6, 32000, generator=_gen())
    x[1, 7] = x[1, 900] = 1e4  # a tie: the first index wins
    x[2, 11] = x[2, 20] = float("nan")  # NaN counts as the largest, the first one wins
    x[3] = -math.inf
    x[4, -1] = math.inf
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x[:, :31990]), x[:, :31990].argmax(dim=-1))  # strided rows


def test_select_follows_the_setting(ops):
    cpu = torch.device("cpu")
    assert kernels.select("auto", cpu, torch.float32) is ops
    assert kernels.select("off", cpu, torch.float32) is None
    assert kernels.select("auto", cpu, torch.bfloat16) is None  # float32 only
    with pytest.raises(ValueError, match="needs device cpu and dtype float32"):
        kernels.select("on", cpu, torch.bfloat16)


def test_a_failed_build_falls_back_or_raises(monkeypatch, caplog):
    def broken(name):
        raise OSError("no compiler here")

    monkeypatch.setattr(kernels, "_build", broken)
    monkeypatch.setattr(kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels.select("auto", torch.device("cpu"), torch.float32) is None
    assert "no compiler here" in caplog.text
    with pytest.raises(RuntimeError, match="did not build: OSError"):
        kernels.cpu_ops(required=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_output_equals_the_pytorch_path(checkpoint_factory, arch):
    """Greedy tokens through prefill, chunked prefill, prefix-cache hits and batched
    decode are equal with kernels on and off; logprobs agree closely."""
    model_dir = str(checkpoint_factory(arch))
    vocab = LLM(model_dir, num_kv_blocks=8, cpu_kernels="off").engine.spec.vocab_size
    g = _gen(5)
    shared = torch.randint(10, vocab, (40,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (3, 29, 70)]
    prompts += [[*shared, 11], [*shared, 12, 13]]  # the second hits the first's blocks
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = {}
    for setting in ("on", "off"):
        llm = LLM(model_dir, num_kv_blocks=128, max_num_batched_tokens=64, cpu_kernels=setting)
        free = llm.engine.block_pool.num_free
        results[setting] = llm.generate(prompts, params)
        assert leftover_holders(llm.engine.block_pool) == []
        assert llm.engine.block_pool.num_free == free
    for on, off in zip(results["on"], results["off"], strict=True):
        assert on.token_ids == off.token_ids
        assert [lp.logprob for lp in on.logprobs] == pytest.approx(
            [lp.logprob for lp in off.logprobs], abs=1e-4
        )


def test_engine_uses_the_kernels(llama_dir, ops):
    assert LLM(str(llama_dir), num_kv_blocks=8).engine.model.kernels is ops
    assert LLM(str(llama_dir), num_kv_blocks=8, cpu_kernels="off").engine.model.kernels is None


def test_prefill_slice_metadata_is_kept_when_fused():
    meta = build_metadata(
        16,
        [[3]],
        [5],
        [PrefillSlice(1, 4, 0, torch.tensor([1]))],
        [52, 16, 17, 18, 19],
        torch.device("cpu"),
        fused=True,
    )
    assert meta.num_decode == 1 and meta.decode_groups == [] and len(meta.prefills) == 1
    assert meta.decode_tables.tolist() == [[3]] and meta.decode_lens.tolist() == [5]
