"""Quantized weights (engine/quant.py) and their CPU kernel (quant_linear.cpp)
against float references: the dequantized weights through torch's matmul."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import engine.kernels as kernels
from engine.kernels import build
from engine.quant import BLOCK, DENSE_ROWS, QuantFormat, QuantWeight

pytestmark = pytest.mark.unit

FORMATS = list(QuantFormat)
HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_kernels = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: no CPU kernels")


@pytest.fixture(scope="module")
def ops():
    return kernels.cpu_ops(required=True)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=_gen(seed)) * 0.05
    w[0, : min(k, 5)] = 0.4  # an outlier row
    if n > 2:
        w[2] = 0  # an all-zero row: scale 0 must not divide
    return w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [32, 100, 576])
def test_dequantized_weights_are_within_half_a_step(fmt, k):
    w = _weights(9, k)
    qw = QuantWeight.quantize(w, fmt)
    back = qw.dequantize()
    assert back.shape == w.shape and qw.out_features == 9 and qw.in_features == k
    blocks = F.pad(w, (0, qw.blocks * BLOCK - k)).view(9, qw.blocks, BLOCK)
    spread = blocks.amax(2) - blocks.amin(2) if fmt >= QuantFormat.Q4_0 else blocks.abs().amax(2)
    levels = {
        QuantFormat.INT8: 127,
        QuantFormat.Q8_0: 127,
        QuantFormat.Q4_0: 7,
        QuantFormat.Q4_1: 15,
    }
    if fmt == QuantFormat.INT8:  # one scale a row
        spread = spread.amax(1, keepdim=True).expand_as(spread)
    step = (spread / levels[fmt]).repeat_interleave(BLOCK, 1)[:, :k]
    # half a step, and float16's rounding of the block's scale and min
    assert ((back - w).abs() <= step * 0.51 + w.abs() * 2e-3 + 1e-6).all()
    assert (back[2] == 0).all()


def test_the_gguf_block_layouts():
    """Bytes as GGUF writes them: float16 scale (and min) first, then the quants,
    4-bit ones with the block's first 16 values in the low nibbles."""
    d, m = torch.tensor([0.5]).half(), torch.tensor([-1.0]).half()
    q = torch.arange(32) % 16
    nibbles = (q[:16] | (q[16:] << 4)).to(torch.uint8)
    q4_1 = torch.cat((d.view(torch.uint8), m.view(torch.uint8), nibbles))
    got = QuantWeight.from_gguf(QuantFormat.Q4_1, q4_1, 32).dequantize()
    assert got[0].tolist() == (q * 0.5 - 1).tolist()
    q4_0 = torch.cat((d.view(torch.uint8), nibbles))
    got = QuantWeight.from_gguf(QuantFormat.Q4_0, q4_0, 32).dequantize()
    assert got[0].tolist() == ((q - 8) * 0.5).tolist()
    q8 = torch.arange(-16, 16, dtype=torch.int8)
    q8_0 = torch.cat((d.view(torch.uint8), q8.view(torch.uint8)))
    got = QuantWeight.from_gguf(QuantFormat.Q8_0, q8_0, 32).dequantize()
    assert got[0].tolist() == (q8.float() * 0.5).tolist()
    with pytest.raises(ValueError, match="rows of 20"):
        QuantWeight.from_gguf(QuantFormat.Q4_1, q4_1[:-1], 32)


def test_cat_stacks_rows_and_refuses_mixed_formats():
    a, b = _weights(5, 64, 1), _weights(3, 64, 2)
    for fmt in FORMATS:
        both = QuantWeight.cat([QuantWeight.quantize(a, fmt), QuantWeight.quantize(b, fmt)])
        expected = torch.cat(
            [QuantWeight.quantize(a, fmt).dequantize(), QuantWeight.quantize(b, fmt).dequantize()]
        )
        assert torch.equal(both.dequantize(), expected)
    with pytest.raises(ValueError, match="one format"):
        QuantWeight.cat([QuantWeight.quantize(a, FORMATS[0]), QuantWeight.quantize(b, FORMATS[1])])


def _rows_quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel's integer path sees it: int8 in blocks of 32, scale max|x| / 127."""
    m, k = x.shape
    nb = -(-k // BLOCK)
    blocks = F.pad(x, (0, nb * BLOCK - k)).view(m, nb, BLOCK)
    amax = blocks.abs().amax(2, keepdim=True)
    # 127 / amax as a true division, as the kernel computes it (torch's scalar /
    # tensor multiplies by a reciprocal, which can move a product across a tie)
    inv = torch.full_like(amax, 127.0) / amax
    q = torch.round(blocks * torch.where(amax > 0, inv, 0))
    return (q * (amax / 127)).view(m, nb * BLOCK)[:, :k]


SHAPES = [(1, 32, 32), (1, 576, 96), (3, 100, 45), (4, 64, 7), (7, 1536, 40)]
SHAPES += [(8, 96, 33), (13, 200, 70), (130, 64, 65), (40, 576, 100), (67, 1000, 47)]
SHAPES += [(9, 32, 1), (512, 576, 81)]  # one column; a prefill's 512 rows


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_quant_linear_equals_the_dequantized_matmul(ops, fmt, m, k, n):
    """Few rows: integer dot products over x quantized in blocks (the reference
    quantizes x the same way); more rows: the integer GEMM over x quantized the
    same way where the build has one for the format (INT8_GEMM_FORMATS), else
    the float32 tiles over dequantized panels. All against float64 sums of the
    dequantized weights."""
    g = _gen(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    x[0, 0] = 6.0  # an outlier activation
    qw = QuantWeight.quantize(_weights(n, k, seed=n), fmt)
    bias = torch.randn(n, generator=g) if n % 2 else None
    got = qw.apply(x, bias, ops)
    integer = m < ops.QUANT_PANEL_ROWS or int(fmt) in ops.INT8_GEMM_FORMATS
    rows = _rows_quantized(x) if integer else x
    want = rows.double() @ qw.dequantize().double().t()
    if bias is not None:
        want += bias.double()
    scale = (x.abs().double() @ qw.dequantize().abs().double().t()).amax()
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=float(scale) * 1e-5 + 1e-6)
    # and close to the unquantized rows through torch (the fallback path)
    fallback = qw.apply(x, bias, None)
    cosine = F.cosine_similarity(got.flatten(), fallback.flatten(), dim=0)
    assert cosine > 0.999


@needs_kernels
def test_the_integer_gemm_takes_the_formats_the_build_can(ops):
    """vpdpbusd (AVX512-VNNI, AVX-VNNI) takes every format; AVX2's vpmaddubsw,
    whose int16 pair sums overflow with 8-bit weights, the 4-bit ones only."""
    four_bit = (int(QuantFormat.Q4_0), int(QuantFormat.Q4_1))
    flags = build.cpu_isa_flags()
    if os.environ.get("TANDEM_KERNEL_ISA") == "avx2":
        assert tuple(ops.INT8_GEMM_FORMATS) == four_bit
    elif "avx512_vnni" in flags or "avx_vnni" in flags:
        assert tuple(ops.INT8_GEMM_FORMATS) == tuple(int(f) for f in FORMATS)
    elif "avx2" in flags:
        assert tuple(ops.INT8_GEMM_FORMATS) == four_bit


@needs_kernels
def test_quant_linear_rows_do_not_depend_on_the_batch(ops):
    """A row's outputs are the same bits alone or among others of one path."""
    x = torch.randn(12, 200, generator=_gen(3))
    for fmt in FORMATS:
        qw = QuantWeight.quantize(_weights(50, 200), fmt)
        alone = torch.cat([qw.apply(x[i : i + 1], None, ops) for i in range(len(x))])
        assert torch.equal(qw.apply(x[:5], None, ops), alone[:5])
        panel = qw.apply(x, None, ops)
        assert torch.equal(qw.apply(x[2:11], None, ops), panel[2:11])


@needs_kernels
def test_quant_linear_refuses_mismatches(ops):
    qw = QuantWeight.quantize(_weights(8, 64), QuantFormat.Q4_1)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.quant_linear(torch.randn(2, 96), qw.data, None, int(qw.format), 8)
    with pytest.raises(RuntimeError, match="unknown quantized format"):
        ops.quant_linear(torch.randn(2, 64), qw.data, None, 7, 8)
    i8 = QuantWeight.quantize(_weights(8, 64), QuantFormat.INT8)
    with pytest.raises(RuntimeError, match="needs scales"):
        ops.quant_linear(torch.randn(2, 64), i8.data, None, 0, 8)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [32, 100, 576])
def test_the_dense_matrix_is_the_dequantized_weights_in_bfloat16(ops, fmt, k):
    """quant_dense_bf16: the weights the blocks stand for, rounded to bfloat16
    (its fused multiply-add may land a float32 ulp from dequantize's, so within
    one bfloat16 step), into a fresh tensor or the one given."""
    qw = QuantWeight.quantize(_weights(40, k), fmt)
    want = qw.dequantize()
    got = ops.quant_dense_bf16(qw.data, qw.scales, int(fmt), k)
    assert got.shape == (40, k) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=0)
    assert (got == want.bfloat16()).float().mean() > 0.99
    buffer = torch.full((40 * k + 64,), 7.0, dtype=torch.bfloat16)
    out = buffer[: 40 * k].view(40, k)
    assert ops.quant_dense_bf16(qw.data, qw.scales, int(fmt), k, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, got)
    assert (buffer[40 * k :] == 7.0).all()  # nothing written past the last row
    with pytest.raises(RuntimeError, match="out must be contiguous bfloat16"):
        ops.quant_dense_bf16(qw.data, qw.scales, int(fmt), k, torch.empty(40, k + 1).bfloat16())


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dense_apply_runs_many_rows_in_bfloat16(ops, fmt):
    """``dense``: from DENSE_ROWS rows the matmul runs in bfloat16 over the dense
    matrix (close to the float64 sums of the dequantized weights, to bfloat16's
    precision); fewer rows, or row_invariant, keep the integer kernels' bits."""
    k, n = 200, 70
    qw = QuantWeight.quantize(_weights(n, k), fmt)
    bias = torch.randn(n, generator=_gen(5))
    x = torch.randn(DENSE_ROWS + 3, k, generator=_gen(6))
    got = qw.apply(x, bias, ops, dense=True)
    want = x.double() @ qw.dequantize().double().t() + bias.double()
    scale = (x.abs().double() @ qw.dequantize().abs().double().t()).amax()
    assert got.dtype == torch.float32 and got.shape == (len(x), n)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=float(scale) * 2e-2)
    assert not torch.equal(got, qw.apply(x, bias, ops))  # not the integer kernels
    few = x[: DENSE_ROWS - 1]
    assert torch.equal(qw.apply(few, bias, ops, dense=True), qw.apply(few, bias, ops))
    invariant = qw.apply(x, bias, ops, row_invariant=True)
    assert torch.equal(qw.apply(x, bias, ops, row_invariant=True, dense=True), invariant)
