"""The GPU attention kernel (engine/gpu/paged_attention.py): against SDPA
over gathered blocks, and inside the engine against the PyTorch path.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1 there): the same kernel source,
so its indexing, masking and online softmax are checked on every run; on a
GPU it is compiled and the engine uses it by itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine
from engine.config import SpeculativeConfig
from engine.gpu import paged_attention as triton_attention
from engine.gpu.paged_attention import PagedBatch
from engine.llm_engine import SCRATCH
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytest.importorskip("triton", reason="Triton is not installed (make setup installs it)")

pytestmark = pytest.mark.unit

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _reference(q, kv, tables, q_lens, seq_lens, scale):
    """SDPA per sequence over its gathered context, causal from its position."""
    out, start = torch.empty_like(q), 0
    for table, q_len, seq_len in zip(tables, q_lens, seq_lens, strict=True):
        context = kv[:, table].flatten(1, 2)[:, :seq_len].float()  # [2, seq_len, kv_heads, d]
        queries = q[start : start + q_len].float().transpose(0, 1)[None]
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= positions
        keys, values = (context[i].transpose(0, 1)[None] for i in (0, 1))
        o = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[start : start + q_len] = o[0].transpose(0, 1).to(q.dtype)
        start += q_len
    return out


# Triton's interpreter multiplies bf16 matrices wrongly (seen with Triton 3.9):
# bf16 is checked where the kernel is compiled.
BF16 = pytest.param(
    "bfloat16", marks=pytest.mark.skipif(not CUDA, reason="bf16 is wrong in Triton's interpreter")
)


def _case(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """A cache with scattered blocks, tables padded with a spare block of NaN
    (read past a sequence's end and the output turns NaN), and queries."""
    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(DEVICE, dt)
    spare, order = num_blocks - 1, torch.randperm(num_blocks - 1).tolist()
    kv[:, spare] = float("nan")
    tables = []
    for n in seq_lens:
        tables.append(order[: -(-n // block_size)])
        order = order[len(tables[-1]) :]
    q = torch.randn(sum(q_lens), heads, head_dim).to(DEVICE, dt)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    width = max(map(len, tables)) + 1
    padded = torch.tensor([t + [spare] * (width - len(t)) for t in tables])
    batch = PagedBatch.build(padded, starts, q_lens, seq_lens, DEVICE)
    expected = _reference(
        q, kv, [torch.tensor(t) for t in tables], q_lens, seq_lens, head_dim**-0.5
    )
    return q, kv, batch, expected


SHAPES = [(4, 2, 32, 16), (8, 8, 16, 8), (6, 2, 24, 16), (16, 4, 64, 16)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "float16", BF16])
def test_kernel_equals_sdpa_over_gathered_blocks(heads, kv_heads, head_dim, block_size, dtype):
    """Decode rows, a prompt with no context, prompt chunks over a cached
    prefix (one past a block edge), tables through scattered blocks."""
    q, kv, batch, expected = _case(
        [1, 17, 33, 70, 5, 90], [1, 1, 20, 70, 3, 1], heads, kv_heads, head_dim, block_size, dtype
    )
    tolerance = 2e-5 if dtype == "float32" else 2e-2
    ours = triton_attention.attend(q, kv, batch, head_dim**-0.5)
    torch.testing.assert_close(ours, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "splits"),
    [(*SHAPES[0], 2), (*SHAPES[0], 7), (*SHAPES[1], 3)],
)
def test_decode_with_split_keys_equals_sdpa(heads, kv_heads, head_dim, block_size, splits):
    """Decode rows whose keys are split into ranges (some of them empty for
    the short rows) and merged: the same as one pass over all keys."""
    q, kv, batch, expected = _case(
        [1, 300, 17, 129, 64], [1] * 5, heads, kv_heads, head_dim, block_size, "float32", seed=2
    )
    ours = triton_attention.attend(q, kv, batch, head_dim**-0.5, splits=splits)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=2e-5)


def test_split_count_follows_the_shape_of_the_batch():
    """Decode launches split keys by the rows and table width alone (a CUDA
    graph replays one split count); prompt launches never split."""
    cpu = torch.device("cpu")  # eight programs is the host's target

    def batch(rows, width, max_q_len=1):
        tables = torch.zeros(rows, width, dtype=torch.long)
        return PagedBatch(tables, tables[:, 0], tables[:, 0], tables[:, 0], max_q_len)

    assert triton_attention.key_splits(batch(1, 4), 16, 2, cpu) == 1  # 64 keys: one range
    assert triton_attention.key_splits(batch(1, 64), 16, 2, cpu) == 4  # 1024 keys, 8 programs
    assert triton_attention.key_splits(batch(1, 64), 16, 8, cpu) == 1  # 8 programs already
    assert triton_attention.key_splits(batch(1, 64, max_q_len=2), 16, 2, cpu) == 1
    q, kv, prompt, _ = _case([40], [40], 4, 2, 16, 16, "float32")
    with pytest.raises(ValueError, match="one-token"):
        triton_attention.attend(q, kv, prompt, 0.25, splits=2)


def test_kernel_rows_do_not_depend_on_a_bound_wider_than_needed():
    """A CUDA graph launches the grid of its shape's bound; a larger
    ``max_q_len`` than the batch needs must change nothing."""
    q, kv, tight, expected = _case([9, 12, 7], [1, 1, 1], 4, 2, 16, 4, "float32", seed=1)
    loose = PagedBatch(tight.tables, tight.q_starts, tight.q_lens, tight.seq_lens, max_q_len=5)
    ours = triton_attention.attend(q, kv, loose, 0.25, splits=1)
    torch.testing.assert_close(ours, triton_attention.attend(q, kv, tight, 0.25, splits=1))
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=2e-5)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(10, 5000, (40,), generator=g).tolist()  # a cached prefix for two
    tails = [torch.randint(10, 5000, (n,), generator=g).tolist() for n in (3, 21, 9, 30)]
    # the last one repeats itself: prompt lookup finds matches
    return [shared + tails[0], tails[1], shared + tails[2], [7, 8, 9, 10] * 9]


def _generate(engine: LLMEngine) -> list[list[int]]:
    out: dict[str, list[int]] = {}

    def drain():
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)

    for i, prompt in enumerate(_prompts()):
        params = SamplingParams(temperature=0, max_tokens=5 + 2 * i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
        if i == 0:  # r0's prefix is cached before r2 arrives
            drain()
    drain()
    return [out[f"r{i}"] for i in range(len(_prompts()))]


def _config(llama_dir, attention: str, **options) -> EngineConfig:
    return EngineConfig(
        model=str(llama_dir),
        num_kv_blocks=48,
        max_num_batched_tokens=32,  # prompts in chunks over their own cached KV
        cpu_kernels="off",
        device=str(DEVICE),
        attention=attention,
        **options,
    )


@pytest.mark.parametrize("mode", ["graphs", "ngram", "draft"])
def test_engine_with_the_kernel_equals_the_sdpa_path(
    llama_dir, checkpoint_factory, monkeypatch, mode
):
    """Greedy tokens through the kernel (on CPU: its interpreter) equal the
    SDPA path's: chunked prompts, a prefix hit and decode batches (every
    mode); the fixed-shape decode runner a CUDA graph replays; speculative
    verify passes
    (several query tokens over the context, beside decode rows), proposed by
    prompt lookup or by a draft model whose passes use the kernel too.
    Every block comes back."""
    options = {}
    if mode == "ngram":
        options["speculative"] = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    if mode == "draft":
        draft = checkpoint_factory("llama", num_hidden_layers=1, hidden_size=64)
        options["speculative"] = SpeculativeConfig(
            method="draft", num_speculative_tokens=3, draft_model=str(draft)
        )
    reference = _generate(LLMEngine(_config(llama_dir, "sdpa", **options)))
    engine = LLMEngine(_config(llama_dir, "triton", **options))
    assert engine.model.gpu_attention
    in_runner: list[bool] = []  # inside the fixed-shape runner's forward
    if mode == "graphs":
        engine.enable_decode_graphs(use_graphs=CUDA)
        runner_forward = engine.decode_graphs.forward

        def forward(*args):
            in_runner.append(True)
            try:
                return runner_forward(*args)
            finally:
                in_runner.pop()

        engine.decode_graphs.forward = forward
    launches: list[tuple[PagedBatch, bool]] = []
    kernel = triton_attention.attend

    def attend(*args):
        launches.append((args[2], bool(in_runner)))
        return kernel(*args)

    monkeypatch.setattr(triton_attention, "attend", attend)
    start = engine.block_pool.num_free
    assert _generate(engine) == reference
    assert any(b.max_q_len > 1 for b, _ in launches)
    assert any(b.max_q_len == 1 for b, _ in launches)
    assert any(runner for _, runner in launches) == (mode == "graphs")
    if "speculative" in options:
        assert engine.speculator.num_proposed > 0
    assert leftover_holders(engine.block_pool, own=[SCRATCH]) == []
    assert engine.block_pool.num_free == start


def test_triton_attention_is_refused_where_it_cannot_run(llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(model=str(llama_dir), attention="triton", deterministic=True)
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="needs a CUDA device"):
            LLMEngine(_config(llama_dir, "triton"))
    auto = LLMEngine(_config(llama_dir, "auto"))
    assert auto.model.gpu_attention == CUDA
