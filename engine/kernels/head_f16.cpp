// greedy_head_f16: the greedy tokens from a float16 copy of the head (half
// the bytes of the float32 one), head.h has the method.

#include "head.h"

#ifdef TANDEM_GREEDY_HEAD
namespace {

#if defined(__AVX512F__)
// AVX-512: R rows (up to 12) times a whole panel, 2R accumulators and the two
// converted panel vectors in registers (tiles at half the linear kernel's
// width made the screen cost more than the float32 logits it saves).
constexpr int kHalfTileRows = 12;

template <int R>
void half_tile(const float* a, int64_t lda, const uint16_t* panel, int64_t k, float* out,
               int64_t ldo) {
  __m512 acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const auto* q = reinterpret_cast<const __m256i*>(panel + p * kPanel);
    const __m512 b0 = _mm512_cvtph_ps(_mm256_loadu_si256(q));
    const __m512 b1 = _mm512_cvtph_ps(_mm256_loadu_si256(q + 1));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + p]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ldo, acc[r][0]);
    _mm512_storeu_ps(out + r * ldo + 16, acc[r][1]);
  }
}

using HalfTile = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t);

template <int... Rs>
constexpr std::array<HalfTile, sizeof...(Rs)> half_tiles(std::integer_sequence<int, Rs...>) {
  return {&half_tile<Rs + 1>...};
}

constexpr std::array<HalfTile, kHalfTileRows> kHalfTiles =
    half_tiles(std::make_integer_sequence<int, kHalfTileRows>{});

// Approximate logits of all m rows over one panel.
void half_panel(const float* a, int64_t lda, int64_t m, const uint16_t* panel, int64_t k,
                float* out, int64_t ldo) {
  for (int64_t i = 0; i < m; i += kHalfTileRows) {
    const int64_t rows = std::min<int64_t>(kHalfTileRows, m - i);
    kHalfTiles[rows - 1](a + i * lda, lda, panel, k, out + i * ldo, ldo);
  }
}
#else
// AVX2: 6-row tiles over half a panel, the rows left over 1-2 at a time.

// Approximate logits of R rows (R <= 2): 8 accumulators and 4 panel vectors,
// named one by one (GCC keeps an array of them on the stack).
template <int R>
void half_panel_rows(const float* a, int64_t lda, const uint16_t* panel, int64_t k, float* out,
                     int64_t ldo) {
  static_assert(R == 1 || R == 2);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
  for (int64_t p = 0; p < k; ++p) {
    const auto* q = reinterpret_cast<const __m128i*>(panel + p * kPanel);
    const __m256 b0 = _mm256_cvtph_ps(_mm_loadu_si128(q));
    const __m256 b1 = _mm256_cvtph_ps(_mm_loadu_si128(q + 1));
    const __m256 b2 = _mm256_cvtph_ps(_mm_loadu_si128(q + 2));
    const __m256 b3 = _mm256_cvtph_ps(_mm_loadu_si128(q + 3));
    const __m256 x = _mm256_broadcast_ss(a + p);
    a0 = _mm256_fmadd_ps(x, b0, a0);
    a1 = _mm256_fmadd_ps(x, b1, a1);
    a2 = _mm256_fmadd_ps(x, b2, a2);
    a3 = _mm256_fmadd_ps(x, b3, a3);
    if constexpr (R == 2) {
      const __m256 y = _mm256_broadcast_ss(a + lda + p);
      c0 = _mm256_fmadd_ps(y, b0, c0);
      c1 = _mm256_fmadd_ps(y, b1, c1);
      c2 = _mm256_fmadd_ps(y, b2, c2);
      c3 = _mm256_fmadd_ps(y, b3, c3);
    }
  }
  _mm256_storeu_ps(out, a0);
  _mm256_storeu_ps(out + 8, a1);
  _mm256_storeu_ps(out + 16, a2);
  _mm256_storeu_ps(out + 24, a3);
  if constexpr (R == 2) {
    _mm256_storeu_ps(out + ldo, c0);
    _mm256_storeu_ps(out + ldo + 8, c1);
    _mm256_storeu_ps(out + ldo + 16, c2);
    _mm256_storeu_ps(out + ldo + 24, c3);
  }
}

// Approximate logits of 6 rows x 16 columns (half a panel, from ``panel``):
// 12 accumulators and 2 panel vectors, each converted once for 6 rows
// instead of once for 2.
void half_rows_6x16(const float* a, int64_t lda, const uint16_t* panel, int64_t k, float* out,
                    int64_t ldo) {
  __m256 acc[6][2];
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const auto* q = reinterpret_cast<const __m128i*>(panel + p * kPanel);
    const __m256 b0 = _mm256_cvtph_ps(_mm_loadu_si128(q));
    const __m256 b1 = _mm256_cvtph_ps(_mm_loadu_si128(q + 1));
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + p);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r) {
    _mm256_storeu_ps(out + r * ldo, acc[r][0]);
    _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
  }
}

// Approximate logits of all m rows over one panel: 6-row tiles over both
// halves of the panel, the rest 1-2 rows at a time.
void half_panel(const float* a, int64_t lda, int64_t m, const uint16_t* panel, int64_t k,
                float* out, int64_t ldo) {
  const int64_t full = m / 6 * 6;
  for (int64_t i = 0; i < full; i += 6)
    for (int half_col = 0; half_col < kPanel; half_col += 16)
      half_rows_6x16(a + i * lda, lda, panel + half_col, k, out + i * ldo + half_col, ldo);
  for (int64_t i = full; i < m; i += 2) {
    if (m - i >= 2)
      half_panel_rows<2>(a + i * lda, lda, panel, k, out + i * ldo, ldo);
    else
      half_panel_rows<1>(a + i * lda, lda, panel, k, out + i * ldo, ldo);
  }
}
#endif

int64_t screened_argmax_f16(const float* x, int64_t k, const float* approx, const double* bound,
                        const float* panels, int64_t n, int64_t max_candidates) {
  double norm2 = 0.0;
  for (int64_t p = 0; p < k; ++p) norm2 += static_cast<double>(x[p]) * x[p];
  if (!std::isfinite(norm2)) return -1;
  const double norm = std::sqrt(norm2) * (1.0 + 1e-12);  // sqrt and sum rounded up
  double floor_ = -std::numeric_limits<double>::infinity();
  int bad = 0;
#pragma omp simd reduction(max : floor_) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    floor_ = std::max(floor_, approx[i] - norm * bound[i]);
    bad |= !std::isfinite(approx[i]);
  }
  if (bad) return -1;
  int64_t best = -1, count = 0;
  float top = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    if (approx[i] + norm * bound[i] < floor_) continue;
    if (++count > max_candidates) return -1;
    const float y = exact_column(x, panels, k, i);
    if (!std::isfinite(y)) return -1;
    if (best < 0 || y > top) best = i, top = y;  // ascending i: the first of equals stays
  }
  return best;
}

}  // namespace

//   x:      [M, K] float32 rows (unit inner stride)
//   panels: the head packed for linear(), [ceil(N / 32), K, 32] float32
//   half:   the same values as float16, same shape
//   bound:  [>= n] float64, per column (see head.h)
//   n:      columns that are tokens (the sampler's vocabulary size)
//   returns [M] int64: the greedy token of each row, or -1
at::Tensor greedy_head_f16(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& half,
                           const at::Tensor& bound, int64_t n, int64_t max_candidates) {
  check_head(x, panels);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(half.scalar_type() == at::kHalf && half.is_contiguous() &&
                  half.sizes() == panels.sizes(),
              "half must be float16 panels of the same shape");
  TORCH_CHECK(bound.scalar_type() == at::kDouble && bound.is_contiguous() && bound.dim() == 1,
              "bound must be contiguous float64 [N]");
  TORCH_CHECK(n >= 1 && n <= panels.size(0) * kPanel && n <= bound.numel(),
              "n = ", n, " is out of range");
  auto out = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return out;
  auto approx = at::empty({m, panels.size(0) * kPanel}, x.options());
  const float* a = x.data_ptr<float>();
  const int64_t lda = x.stride(0), ldo = approx.size(1);
  const float* w = panels.data_ptr<float>();
  const auto* h = reinterpret_cast<const uint16_t*>(half.data_ptr<at::Half>());
  float* ap = approx.data_ptr<float>();
  // Threads split the panels, then the rows, as linear() does.
  const int64_t grain = m * k * n < (1 << 21) ? panels.size(0) : 1;
  at::parallel_for(0, panels.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      half_panel(a, lda, m, h + t * k * kPanel, k, ap + t * kPanel, ldo);
  });
  int64_t* op = out.data_ptr<int64_t>();
  const double* bp = bound.data_ptr<double>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      op[r] = screened_argmax_f16(a + r * lda, k, ap + r * ldo, bp, w, n, max_candidates);
  });
  return out;
}
#endif  // TANDEM_GREEDY_HEAD
