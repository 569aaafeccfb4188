// Greedy tokens from the head without the full float32 logits.
//
// At a small decode batch the head's matmul streams its weight (32k x 256
// floats, 32 MB, for the default model) from memory; at a larger one it is
// the step's largest block of arithmetic. A screen reads a smaller copy of
// the head for approximate logits and bounds each one's distance from the
// float32 logit y_i the linear kernel would give. Every column whose
// interval can reach the highest lower bound is a candidate; the argmax is
// one of them. Candidates get the linear kernel's exact sum (the same
// in-order FMAs, so the same bits), and the first largest wins, as
// argmax_rows. A row whose candidates exceed ``max_candidates``, or with a
// value that is not finite, gets -1: the caller computes its logits in full.
//
// greedy_head_f16 reads a float16 copy (half the bytes):
//   |y~_i - y_i| <= ||x|| bound_i, bound_i (engine.kernels.HalfHead) being
//   ||w_i - w~_i|| plus the float32 rounding of both sums.
//
// greedy_head_i8 reads an int8 copy (a quarter of the bytes; AVX2's
// vpmaddubsw does 32 multiply-adds an instruction, AVX512-VNNI's vpdpbusd
// 64, an AMX tdpbusd 16K). With w~_i = s_i q_i the column quantized
// (engine.kernels.Int8Head) and x~ = s_x q_x the row quantized here (8 bits
// where the sums are int32, 6 bits for AVX2, |q_x| <= 31, so that four
// products sum in int16):
//   |x~ . w~_i - y_i| <= ||x|| E_i + ||x - x~|| W_i,
// E_i = ||w_i - w~_i|| plus the float32 rounding of y_i (gamma_K ||w_i||),
// W_i = ||w~_i||. The integer sums are exact; the float arithmetic that
// scales them and the bound gets a relative slack. Three passes per row:
//   1. every column's x~ . w~_i, the test above (tens of the default model's
//      32k columns pass, a few hundred at most in our runs);
//   2. for those, x . w~_i from the int8 column and x itself, within
//      ||x|| (E_i + gamma_K W_i): the row quantization's share is gone, and
//      the same test leaves 1 to 7 (more than kMaxScreened after pass 1: -1);
//   3. for those, the exact sums.
// The row quantization's share of the bound grows with sqrt(K) against the
// spread of the logits, so the int8 screen suits narrow models only (the
// engine takes it up to a hidden size of 512 with 6-bit rows, 2048 with 8,
// engine.kernels.INT8_MAX_HIDDEN).
//
// head_f16.cpp holds the float16 screen, head_i8.cpp the int8 one and
// head_amx.cpp the int8 screen's first pass on AMX tiles; this header what
// they share. Built only where the compiler targets AVX2, F16C and FMA.
#pragma once

#include "common.h"

#ifdef TANDEM_GREEDY_HEAD
#include <immintrin.h>

namespace {

// Column j of a packed weight times x, as the linear kernel sums it.
[[maybe_unused]] float exact_column(const float* x, const float* panels, int64_t k, int64_t j) {
  const float* w = panels + (j / kPanel) * k * kPanel + j % kPanel;
  float acc = 0.f;
  for (int64_t p = 0; p < k; ++p) acc = std::fma(x[p], w[p * kPanel], acc);
  return acc;
}

// Rows of greedy_head_f16 past which its screen costs more than the float32
// logits (the engine computes those; cpu_ops.HALF_SCREEN_MAX_ROWS): with
// AVX-512 the screen is compute-bound past a few rows; the AVX2 screen kept
// up at every batch size measured.
#if defined(__AVX512F__)
constexpr int64_t kHalfScreenMaxRows = 4;
#else
constexpr int64_t kHalfScreenMaxRows = std::numeric_limits<int32_t>::max();
#endif

constexpr int kGroup = 4;  // k values per int8 group (one int32 lane)
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// vpdpbusd and tdpbusd sum their products in int32: x takes 8 bits, and the
// row quantization's share of the first pass's bound is a quarter of 6 bits'.
constexpr int kQuantMax = 127;
constexpr int kQuantOffset = 128;
#else
constexpr int kQuantMax = 31;  // |q_x|: 4 products of u8 (q_x + 32) and s8 fit int16
constexpr int kQuantOffset = 32;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// 16 columns' int32 sums of a row -> its approximate logits at ``out``: the
// offset's share off, then the column and row scales.
inline void store_logits16(__m512i sums, const int32_t* colsum, const float* col_scale,
                           float row_scale, float* out) {
  const __m512i shift = _mm512_mullo_epi32(_mm512_set1_epi32(kQuantOffset),
                                           _mm512_loadu_si512(colsum));
  const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, shift));
  const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(col_scale), _mm512_set1_ps(row_scale));
  _mm512_storeu_ps(out, _mm512_mul_ps(dot, s));
}
#endif

// Rows x [M, K] and a head packed for linear() over K inputs.
[[maybe_unused]] void check_head(const at::Tensor& x, const at::Tensor& panels) {
  check_rows(x, "x");
  check_f32(panels, "panels");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel &&
                  panels.size(1) == x.size(1),
              "panels must be contiguous [P, ", x.size(1), ", ", kPanel, "]");
}

}  // namespace

// One row quantized: (q_x + kQuantOffset) bytes (zero padding quantizes to
// the offset and meets zero weights), its scale, ||x|| and ||x - x~||. ``ok`` is false when
// the row is zero or not finite (the screen cannot settle it).
struct RowQuant {
  float scale = 0.f;
  double norm = 0.0, error = 0.0;
  bool ok = false;
};

#ifdef TANDEM_AMX_SCREEN
// head_amx.cpp: the int8 screen's first pass over panels [begin, end) on AMX
// tiles (greedy_head_i8 runs it where amx_usable()).
void int8_screen_amx(const uint8_t* xq, int64_t padded, int64_t m, const int8_t* w8,
                     const int32_t* colsum, const float* col_scale, const RowQuant* quant,
                     float* approx, int64_t ncols, int64_t begin, int64_t end);
#endif

#endif  // TANDEM_GREEDY_HEAD
