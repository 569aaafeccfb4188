"""The screened greedy head (cpu_ops greedy_head_i8 and greedy_head_f16,
engine.kernels.Int8Head and HalfHead): the same tokens as the float32 logits'
argmax, from an int8 or float16 read of the head."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import engine.kernels as kernels
from engine import LLM
from engine.models import llama
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the engine runs its PyTorch path", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    ops = kernels.cpu_ops(required=True)
    if not hasattr(ops, "greedy_head_i8"):
        pytest.skip("this CPU has no AVX2/F16C/FMA: the engine computes full logits")
    return ops


def _head(k: int, n: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(k, n, generator=torch.Generator().manual_seed(seed)) * scale


def _full(ops, x: torch.Tensor, head: kernels.PackedWeight, n: int) -> torch.Tensor:
    return ops.argmax_rows(ops.linear(x, head.panels, head.out_features)[:, :n].contiguous())


SCREENS = {"int8": kernels.Int8Head, "float16": kernels.HalfHead}


def _screened(ops, x, head, n, max_candidates=64, kind="int8"):
    screen = SCREENS[kind].of(head)
    assert screen is not None
    return screen.tokens(ops, x, head, n, max_candidates)


@pytest.mark.parametrize("kind", SCREENS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 16])
@pytest.mark.parametrize(
    "k,n,vocab,scale",
    [(256, 32000, 32000, 0.02), (64, 1000, 990, 1.0), (70, 333, 333, 0.3), (3, 40, 40, 1.0)],
)
def test_tokens_equal_the_full_logits_argmax(ops, kind, rows, k, n, vocab, scale):
    head = kernels.PackedWeight.pack(_head(k, n, scale, seed=rows))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)) * 3
    tokens = _screened(ops, x, head, vocab, kind=kind)
    assert torch.equal(tokens, _full(ops, x, head, vocab))


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
@pytest.mark.parametrize("k,n", [(256, 32000), (70, 995), (200, 4000), (512, 700)])
def test_the_amx_screen_gives_the_vector_screens_tokens(ops, rows, k, n):
    """AMX tiles (16 rows a tile, a k tail of fewer than 64 values when k is not
    a multiple of 64) sum the same integers as the vector path."""
    if not ops.amx_screen():
        pytest.skip("no AMX here (or Linux refused the tile state): the vector path runs")
    head = kernels.PackedWeight.pack(_head(k, n, 0.05, seed=k + rows))
    screen = kernels.Int8Head.of(head)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    args = (x, head.panels, screen.q8, screen.colsum, screen.columns, n - 3, 64)
    tiles, vectors = ops.greedy_head_i8(*args, amx=True), ops.greedy_head_i8(*args, amx=False)
    assert torch.equal(tiles, vectors)
    assert torch.equal(tiles, _full(ops, x, head, n - 3))


def _dequantized(screen: kernels.Int8Head, k: int, n: int) -> torch.Tensor:
    """w~ as [k, n] float64, from the int8 panels and their scales."""
    q = screen.q8.transpose(2, 3).reshape(screen.q8.shape[0], -1, kernels.PANEL_WIDTH)[:, :k]
    w = q.double() * screen.columns[0].view(-1, 1, kernels.PANEL_WIDTH).double()
    return w.transpose(0, 1).reshape(k, -1)[:, :n]


def test_the_int8_bounds_hold(ops):
    """Both screens' bounds, with the exact logits as the linear kernel sums them:
    x~ . w~ (quantized rows, the first pass) is within ||x|| E + ||x - x~|| W,
    and x . w~ (the second) within ||x|| (E + gamma_K W)."""
    k, n = 96, 300
    w = _head(k, n, 0.5, seed=3)
    head = kernels.PackedWeight.pack(w)
    screen = kernels.Int8Head.of(head)
    x = torch.randn(50, k, generator=torch.Generator().manual_seed(4)) * 10
    exact = ops.linear(x, head.panels, n).double()
    w_q = _dequantized(screen, k, n)
    assert float((w_q - w.double()).abs().max()) > 0  # the screen is approximate
    error, norm = screen.columns[1, :n].double(), screen.columns[2, :n].double()
    xd = x.double()
    levels = ops.INT8_ROW_LEVELS  # as the kernel quantizes rows: 8 bits, or 6 for AVX2
    scale = x.abs().amax(dim=1, keepdim=True) / levels
    x_q = torch.round(x / scale).clamp(-levels, levels).double() * scale.double()
    first = x_q @ w_q
    radius = xd.norm(dim=1, keepdim=True) * error + (xd - x_q).norm(dim=1, keepdim=True) * norm
    assert bool(((first - exact).abs() <= radius).all())
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    second = xd @ w_q
    assert bool(
        ((second - exact).abs() <= xd.norm(dim=1, keepdim=True) * (error + gamma * norm)).all()
    )
    assert float((second - exact).abs().max()) > 0


def _near_ties() -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose columns 7 and 40 tie exactly and 8 and 41 differ by a hair
    (41 ahead), and rows for which those columns lead."""
    w = _head(64, 96, 0.05, seed=5)
    w[:, 7] += 0.5  # columns 7 and 8 lead for most rows
    w[:, 8] += 0.5
    w[:, 40] = w[:, 7]  # an exact tie: column 7 wins
    w[:, 41] = w[:, 8]
    w[0, 41] += 1e-6  # below int8 and float16 resolution: 41 beats 8 by a hair
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(6))
    x[:, 0] = 1.0
    return w, x


def _assert_ties_settled_exactly(ops, x, head, kind):
    full = _full(ops, x, head, 96)
    assert torch.equal(_screened(ops, x, head, 96, kind=kind), full)
    assert 7 in full.tolist() and 40 not in full.tolist()
    assert 41 in full.tolist() and 8 not in full.tolist()


def test_columns_int8_cannot_tell_apart_are_settled_exactly(ops):
    """Columns equal in int8 but not in float32: the exact sums decide, and an
    exact tie goes to the first column, as argmax does."""
    w, x = _near_ties()
    head = kernels.PackedWeight.pack(w)
    screen = kernels.Int8Head.of(head)
    assert torch.equal(screen.q8[1, :, 41 - 32], screen.q8[0, :, 8])  # the same in int8
    assert screen.columns[0, 41] == screen.columns[0, 8]
    _assert_ties_settled_exactly(ops, x, head, "int8")


def test_the_float16_bound_holds(ops):
    """|x . w~_i - x . w_i| <= ||x|| * bound_i, with both sums as computed."""
    w = _head(96, 300, 0.5, seed=3)
    head = kernels.PackedWeight.pack(w)
    half = kernels.HalfHead.of(head)
    x = torch.randn(50, 96, generator=torch.Generator().manual_seed(4)) * 10
    exact = ops.linear(x, head.panels, 300).double()
    approx = ops.linear(x, kernels.PackedWeight.pack(w.half().float()).panels, 300).double()
    slack = x.double().norm(dim=1, keepdim=True) * half.bound[:300]
    assert bool(((approx - exact).abs() <= slack).all())
    assert float((approx - exact).abs().max()) > 0  # the screen is approximate


def test_columns_float16_cannot_tell_apart_are_settled_exactly(ops):
    """The same with columns equal in float16."""
    w, x = _near_ties()
    head = kernels.PackedWeight.pack(w)
    half = kernels.HalfHead.of(head).half
    assert torch.equal(half[1, :, 41 - 32], half[0, :, 8])  # the same in float16
    _assert_ties_settled_exactly(ops, x, head, "float16")


@pytest.mark.parametrize("kind", SCREENS)
def test_rows_it_cannot_settle_are_left_to_the_caller(ops, kind):
    head = kernels.PackedWeight.pack(_head(32, 64, 1.0, seed=7))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(8))
    x[1] = 0.0  # every column ties: more candidates than allowed
    x[2, 5] = math.nan
    tokens = _screened(ops, x, head, 64, max_candidates=8, kind=kind)
    assert tokens[1:].tolist() == [-1, -1]
    assert tokens[0] == _full(ops, x[:1], head, 64)[0]


def test_a_head_with_outliers_screens_and_one_not_finite_does_not(ops):
    w = _head(32, 40, 1.0, seed=9)
    w[3, 5] = 1e5  # one column's scale is huge: its other weights quantize to 0
    head = kernels.PackedWeight.pack(w)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10))
    assert torch.equal(_screened(ops, x, head, 40), _full(ops, x, head, 40))
    w[3, 5] = math.inf
    assert kernels.Int8Head.of(kernels.PackedWeight.pack(w)) is None


def test_a_head_float16_cannot_hold_gets_no_screen():
    w = _head(32, 40, 1.0, seed=9)
    w[3, 5] = 1e5
    assert kernels.HalfHead.of(kernels.PackedWeight.pack(w)) is None
    w[3, 5] = math.inf
    assert kernels.HalfHead.of(kernels.PackedWeight.pack(w)) is None


@pytest.mark.parametrize("levels", [31, 127])
def test_narrow_heads_get_the_int8_screen_and_wide_ones_float16(levels):
    """The limit follows the kernel's row quantization: 6 bits (AVX2) or 8."""

    def screen(k):
        head = kernels.PackedWeight.pack(_head(k, 40, 0.1, seed=k))
        return type(kernels.screen_for(head, levels))

    widest = kernels.INT8_MAX_HIDDEN[levels]
    assert screen(widest) is kernels.Int8Head
    assert screen(widest + 8) is kernels.HalfHead
    assert kernels.INT8_MAX_HIDDEN[127] > kernels.INT8_MAX_HIDDEN[31]


def test_a_wide_head_screens_with_8_bit_rows(ops):
    """Where the kernel quantizes rows to 8 bits, a head of hidden size 1024
    (past the 6-bit limit) settles its rows with the int8 screen."""
    if ops.INT8_ROW_LEVELS != 127:
        pytest.skip("6-bit rows here (AVX2): such heads get the float16 screen")
    k, n = 1024, 4000
    head = kernels.PackedWeight.pack(_head(k, n, 0.02, seed=11))
    assert isinstance(kernels.screen_for(head, ops.INT8_ROW_LEVELS), kernels.Int8Head)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(12)) * 3
    tokens = _screened(ops, x, head, n)
    assert torch.equal(tokens, _full(ops, x, head, n))  # every row settled, and right


@pytest.mark.slow
def test_the_engine_screens_plain_greedy_rows_only(llama_dir, ops, monkeypatch):
    """Plain greedy decoding goes through the screen and gives the tokens of
    the full logits; rows that ask for logprobs take the full logits. A
    screen that settles nothing (every row recomputed) changes no token."""
    prompts = [[5, 17, 300, 42], list(range(20, 60)), [9] * 7]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    calls = []
    screen = llm.engine.model.greedy_tokens
    monkeypatch.setattr(llm.engine.model, "greedy_tokens", lambda *a: calls.append(1) or screen(*a))
    free = llm.engine.block_pool.num_free
    screened = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert len(calls) >= 16 and llm.engine.block_pool.num_free == free
    assert leftover_holders(llm.engine.block_pool) == []

    calls.clear()
    with_logprobs = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    assert [o.token_ids for o in llm.generate(prompts, with_logprobs)] == screened
    assert calls == []

    assert isinstance(llm.engine.model.screen_head, kernels.Int8Head)
    assert llm.engine.model.screen_misses < llm.engine.model.screen_rows
    # Narrower than this model's 128, whichever rows the kernel quantizes.
    monkeypatch.setattr(kernels, "INT8_MAX_HIDDEN", {31: 64, 127: 64})
    wide = LLM(str(llama_dir), num_kv_blocks=64)
    assert isinstance(wide.engine.model.screen_head, kernels.HalfHead)
    assert [o.token_ids for o in wide.generate(prompts, greedy)] == screened
    assert wide.engine.model.screen_misses < wide.engine.model.screen_rows  # it settles rows
    # Past HALF_SCREEN_MAX_ROWS rows (4 on AVX-512) the float16 screen costs more
    # than it saves: such batches take the full logits, with the same tokens.
    assert wide.engine.model.screen_max_rows == ops.HALF_SCREEN_MAX_ROWS
    wide.engine.model.screen_max_rows = 1
    sizes, tokens = [], kernels.HalfHead.tokens
    monkeypatch.setattr(
        kernels.HalfHead, "tokens", lambda self, *a: sizes.append(len(a[1])) or tokens(self, *a)
    )
    assert [o.token_ids for o in wide.generate(prompts, greedy)] == screened
    assert max(sizes, default=1) == 1

    monkeypatch.setattr(llama, "MAX_CANDIDATES", 0)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == screened
    full = LLM(str(llama_dir), num_kv_blocks=64, greedy_screen=False)
    assert full.engine.model.screen_head is None  # no copy of the head is kept
    assert [o.token_ids for o in full.generate(prompts, greedy)] == screened


@pytest.mark.slow
def test_a_screen_that_mostly_misses_is_dropped(llama_dir, ops, monkeypatch, caplog):
    """Rows the screen cannot settle cost the screen and then the full logits:
    past the trial, a model that mostly misses goes back to full logits, and
    its tokens do not change."""
    prompts = [[5, 17, 300, 42], list(range(20, 60))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        o.token_ids for o in LLM(str(llama_dir), num_kv_blocks=64).generate(prompts, greedy)
    ]
    monkeypatch.setattr(llama, "MAX_CANDIDATES", 0)  # every row misses
    monkeypatch.setattr(llama, "SCREEN_TRIAL_ROWS", 8)
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    model = llm.engine.model
    with caplog.at_level("WARNING", logger="engine.models.llama"):
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    assert model.screen_head is None
    assert 8 <= model.screen_rows < 24  # dropped soon after the trial, not at the end
    assert "computing full logits" in caplog.text
