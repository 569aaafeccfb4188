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
from engine.gpu import paged_attention as gpu
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


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(4, 2, 32, 16), (8, 8, 16, 8), (6, 2, 24, 16), (16, 4, 64, 16)],
)
@pytest.mark.parametrize("dtype", ["float32", "float16", BF16])
def test_kernel_equals_sdpa_over_gathered_blocks(heads, kv_heads, head_dim, block_size, dtype):
    """Decode rows, a prompt with no context, prompt chunks over a cached
    prefix (one past a block edge), tables through scattered blocks."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    seq_lens = [1, 17, 33, 70, 5, 90]
    q_lens = [1, 1, 20, 70, 3, 1]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(DEVICE, dt)
    order, tables = torch.randperm(num_blocks).tolist(), []
    for n in seq_lens:
        tables.append(order[: -(-n // block_size)])
        order = order[len(tables[-1]) :]
    q = torch.randn(sum(q_lens), heads, head_dim).to(DEVICE, dt)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    batch = PagedBatch.build(padded, starts, q_lens, seq_lens, DEVICE)
    ours = gpu.paged_attention(q, kv, batch, head_dim**-0.5)
    expected = _reference(
        q, kv, [torch.tensor(t) for t in tables], q_lens, seq_lens, head_dim**-0.5
    )
    tolerance = 2e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(ours, expected, atol=tolerance, rtol=tolerance)


def test_kernel_rows_do_not_depend_on_a_bound_wider_than_needed():
    """A CUDA graph launches the grid of its shape's bound; a larger
    ``max_q_len`` than the batch needs must change nothing."""
    torch.manual_seed(1)
    kv = torch.randn(2, 8, 4, 2, 16).to(DEVICE)
    q = torch.randn(3, 4, 16).to(DEVICE)
    tables = torch.tensor([[3, 1, 0], [5, 6, 7], [2, 4, 0]])
    tight = PagedBatch.build(tables, [0, 1, 2], [1, 1, 1], [9, 12, 7], DEVICE)
    loose = PagedBatch(tight.tables, tight.q_starts, tight.q_lens, tight.seq_lens, max_q_len=5)
    torch.testing.assert_close(
        gpu.paged_attention(q, kv, tight, 0.25), gpu.paged_attention(q, kv, loose, 0.25)
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(10, 5000, (40,), generator=g).tolist()  # a cached prefix for two
    tails = [torch.randint(10, 5000, (n,), generator=g).tolist() for n in (3, 21, 9, 30)]
    return [shared + tails[0], tails[1], shared + tails[2], tails[3]]


def _generate(engine: LLMEngine) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(_prompts()):
        params = SamplingParams(temperature=0, max_tokens=5 + 2 * i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
        if i == 0:  # r0's prefix is cached before r2 arrives
            while engine.has_unfinished():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(_prompts()))]


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_with_the_kernel_equals_the_pytorch_path(llama_dir, monkeypatch, graphs):
    """Greedy tokens through the kernel (chunked prompts, a prefix hit, decode
    batches, and the fixed-shape decode runner a CUDA graph replays) equal the
    PyTorch path's; every block comes back."""
    config = EngineConfig(
        model=str(llama_dir),
        num_kv_blocks=48,
        max_num_batched_tokens=32,  # prompts in chunks over their own cached KV
        cpu_kernels="off",
        device=str(DEVICE),
    )
    monkeypatch.setattr(gpu, "available", lambda device: False)
    reference = _generate(LLMEngine(config))
    monkeypatch.setattr(gpu, "available", lambda device: True)  # on CPU: the interpreter
    engine = LLMEngine(config)
    if graphs:
        engine.enable_decode_graphs(use_graphs=CUDA)
    launches = []
    kernel = gpu.paged_attention
    monkeypatch.setattr(gpu, "paged_attention", lambda *a: launches.append(a[2]) or kernel(*a))
    start = engine.block_pool.num_free
    assert _generate(engine) == reference
    assert any(b.max_q_len > 1 for b in launches) and any(b.max_q_len == 1 for b in launches)
    assert leftover_holders(engine.block_pool, own=[SCRATCH]) == []
    assert engine.block_pool.num_free == start
