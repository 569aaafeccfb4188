// Quantized linear layers: y = x @ W^T (+ bias), W [N, K] stored row by row
// in blocks of 32 inputs (engine/quant.py writes them; its QuantFormat names
// the codes):
//   0 int8  per output row: 32 int8 a block, one float32 scale a row (``scales``)
//   1 Q8_0  GGUF's: a float16 scale d, 32 int8;           w = d q
//   2 Q4_0  GGUF's: d, 16 bytes of 4-bit q (low nibbles the block's first 16);
//                                                          w = d (q - 8)
//   3 Q4_1  GGUF's: d, a float16 min m, 16 bytes of q;     w = d q + m
// The last block of a row is zero-padded past K.
//
// Few rows (a decode batch: the weights' bytes are the cost) take integer
// dot products: each row of x is quantized to int8 in blocks of 32 (scale
// d_x = max|x| / 127, as llama.cpp's Q8 activations), every weight block is
// read once for all rows, and a block's 32 products sum in int32 (AVX512-VNNI
// or AVX-VNNI vpdpbusd; AVX2 vpmaddubsw + vpmaddwd; scalar elsewhere), then
// scale into a float32 sum: y = sum_b d_w d_x isum_b (+ m_b sum(x_b)).
// More rows (a prefill: arithmetic is the cost) dequantize one panel of 32
// output rows into float32 and run the linear kernel's tiles over every row.
// ``row_invariant`` keeps every row count on the integer path, whose sums for
// a row are the same whatever the other rows (deterministic mode).

#include "linear_tiles.h"
#include "quant_blocks.h"

namespace {

#if defined(__AVX2__)
// Block b (``len`` inputs) of output rows [first, first + cols) dequantized
// into the panel's rows b * 32 .. b * 32 + len (``out``), in 8 x 8 transposes.
template <int F>
void panel_block(const uint8_t* w, int64_t row_bytes, const float* scales, int64_t first, int cols,
                 int64_t b, int len, float* out) {
  alignas(32) uint8_t q[kPanel][kBlock] = {};
  float d[kPanel] = {}, min[kPanel] = {};
  for (int j = 0; j < cols; ++j) {
    const uint8_t* p = w + (first + j) * row_bytes + b * kBlockBytes[F];
    const __m256i v = load_q<F>(p, F == kInt8 ? scales[first + j] : 1.f, d[j], min[j]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[j]), v);
  }
  for (int jj = 0; jj < kPanel; jj += 8) {
    for (int ee = 0; ee < len; ee += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[jj + i] + ee));
        const __m256i wide = F <= kQ8_0 ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
        r[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(d[jj + i]),
                               _mm256_set1_ps(min[jj + i]));
      }
      transpose8(r);
      for (int e = 0; e < 8 && ee + e < len; ++e)
        _mm256_storeu_ps(out + (ee + e) * kPanel + jj, r[e]);
    }
  }
}

// One weight block (at ``p``) times block b of rows [i0, i0 + R) of x, into
// ``acc`` (and the 4-bit formats' min terms into ``mins``).
template <int F, int R>
inline void dot_block(const RowBlocks& x, int64_t i0, int64_t nb, int64_t b, const uint8_t* p,
                      __m256* acc, float* mins) {
  constexpr bool kSigned = F <= kQ8_0;
  float d, min;
  const __m256i q = load_q<F>(p, 1.f, d, min);
  const __m256i u = kSigned ? _mm256_sign_epi8(q, q) : q;  // |q| for signed weights
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const int64_t at = (i0 + r) * nb + b;
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + at * kBlock));
    if constexpr (kSigned) xv = _mm256_sign_epi8(xv, q);  // q x = |q| (sign(q) x)
    const __m256 sums = _mm256_cvtepi32_ps(dot_u8s8(u, xv));
    acc[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(d * x.d[at]), acc[r]);
    if constexpr (F >= kQ4_0) mins[r] += min * x.sum[at];
  }
}

// Rows [i0, i0 + R) of x times one weight row: out[r * ldc]. Even and odd
// blocks sum into separate accumulators (two chains of multiply-adds).
template <int F, int R>
void dot_rows(const RowBlocks& x, int64_t i0, int64_t nb, const uint8_t* w, float scale, float* out,
              int64_t ldc) {
  __m256 even[R], odd[R];
  float mins[R] = {};
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    dot_block<F, R>(x, i0, nb, b, w + b * kBlockBytes[F], even, mins);
    dot_block<F, R>(x, i0, nb, b + 1, w + (b + 1) * kBlockBytes[F], odd, mins);
  }
  if (b < nb) dot_block<F, R>(x, i0, nb, b, w + b * kBlockBytes[F], even, mins);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r * ldc] = hsum(_mm256_add_ps(even[r], odd[r])) * scale + mins[r];
}
#else
template <int F>
void panel_block(const uint8_t* w, int64_t row_bytes, const float* scales, int64_t first, int cols,
                 int64_t b, int len, float* out) {
  uint8_t nibbles[kBlock];
  for (int j = 0; j < kPanel; ++j) {
    if (j >= cols) {
      for (int e = 0; e < len; ++e) out[e * kPanel + j] = 0.f;
      continue;
    }
    float d, min;
    const uint8_t* p = w + (first + j) * row_bytes + b * kBlockBytes[F];
    const uint8_t* q = block_q<F>(p, nibbles, d, min);
    const float scale = F == kInt8 ? scales[first + j] : 1.f;
    for (int e = 0; e < len; ++e)
      out[e * kPanel + j] = F <= kQ8_0 ? static_cast<float>(static_cast<int8_t>(q[e])) * d * scale
                                       : std::fma(static_cast<float>(q[e]), d, min);
  }
}

template <int F, int R>
void dot_rows(const RowBlocks& x, int64_t i0, int64_t nb, const uint8_t* w, float scale, float* out,
              int64_t ldc) {
  uint8_t nibbles[kBlock];
  for (int r = 0; r < R; ++r) {
    float total = 0.f, mins = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float d, min;
      const uint8_t* q = block_q<F>(w + b * kBlockBytes[F], nibbles, d, min);
      const int64_t at = (i0 + r) * nb + b;
      const int8_t* xq = x.q.data() + at * kBlock;
      int32_t isum = 0;
      for (int j = 0; j < kBlock; ++j)
        isum += (F <= kQ8_0 ? static_cast<int8_t>(q[j]) : static_cast<int32_t>(q[j])) * xq[j];
      total += static_cast<float>(isum) * d * x.d[at];
      if (F >= kQ4_0) mins += min * x.sum[at];
    }
    out[r * ldc] = total * scale + mins;
  }
}
#endif

template <int F>
void integer_path(const float* a, int64_t lda, int64_t m, int64_t k, const uint8_t* w,
                  const float* scales, int64_t n, float* c) {
  const int64_t nb = (k + kBlock - 1) / kBlock, row_bytes = nb * kBlockBytes[F];
  const RowBlocks x = quantize_rows(a, lda, m, k, nb);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, m * k));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = w + j * row_bytes;
      const float scale = F == kInt8 ? scales[j] : 1.f;
      int64_t i = 0;
      for (; i + 4 <= m; i += 4) dot_rows<F, 4>(x, i, nb, row, scale, c + i * n + j, n);
      for (; i < m; ++i) dot_rows<F, 1>(x, i, nb, row, scale, c + i * n + j, n);
    }
  });
}

template <int F>
void panel_path(const float* a, int64_t lda, int64_t m, int64_t k, const uint8_t* w,
                const float* scales, int64_t n, float* c) {
  const int64_t row_bytes = (k + kBlock - 1) / kBlock * kBlockBytes[F];
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(k * kPanel);
    for (int64_t t = begin; t < end; ++t) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - t * kPanel));
      for (int64_t b = 0; b * kBlock < k; ++b) {
        const int len = static_cast<int>(std::min<int64_t>(kBlock, k - b * kBlock));
        panel_block<F>(w, row_bytes, scales, t * kPanel, cols, b, len,
                       panel.data() + b * kBlock * kPanel);
      }
      const int64_t full = m / kTileRows * kTileRows;
      for (int64_t i = 0; i < m;) {
        const bool main = i < full;
        const int rows = main ? kTileRows : static_cast<int>(std::min<int64_t>(kRestRows, m - i));
        panel_tile(a + i * lda, lda, rows, main, i == 0, panel.data(), k, nullptr,
                   c + i * n + t * kPanel, n, cols);
        i += rows;
      }
    }
  });
}

using Path = void (*)(const float*, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                      int64_t, float*);
constexpr Path kInteger[4] = {&integer_path<kInt8>, &integer_path<kQ8_0>, &integer_path<kQ4_0>,
                              &integer_path<kQ4_1>};
constexpr Path kPanels[4] = {&panel_path<kInt8>, &panel_path<kQ8_0>, &panel_path<kQ4_0>,
                             &panel_path<kQ4_1>};

}  // namespace

//   x:       [M, K] float32, unit stride within a row
//   weight:  [N, ceil(K / 32) * block bytes] int8 or uint8, contiguous
//   scales:  [N] float32 for format 0 (int8), else None
//   returns  [M, N] = x @ W^T (+ bias)
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& scales, int64_t format, int64_t n,
                        const std::optional<at::Tensor>& bias, bool row_invariant) {
  check_rows(x, "x");
  TORCH_CHECK(format >= kInt8 && format <= kQ4_1, "unknown quantized format ", format);
  const int64_t m = x.size(0), k = x.size(1), nb = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.device().is_cpu() && weight.element_size() == 1 && weight.is_contiguous() &&
                  weight.dim() == 2 && weight.size(0) == n &&
                  weight.size(1) == nb * kBlockBytes[format],
              "weight must be contiguous 1-byte [", n, ", ", nb * kBlockBytes[format],
              "] for format ", format, " and ", k, " inputs");
  const float* sp = row_scales(scales, format, n);
  const float* bp = bias_data(bias, n);
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  float* c = out.data_ptr<float>();
  if (m < kQuantPanelRows || row_invariant)
    kInteger[format](x.data_ptr<float>(), x.stride(0), m, k, w, sp, n, c);
  else if (int8_gemm_supports(format))
    int8_gemm(format, x.data_ptr<float>(), x.stride(0), m, k, w, sp, n, c);
  else
    kPanels[format](x.data_ptr<float>(), x.stride(0), m, k, w, sp, n, c);
  if (bp != nullptr)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += bp[j];
  return out;
}
