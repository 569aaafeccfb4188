// greedy_head_i8: the greedy tokens from an int8 copy of the head (a quarter
// of the bytes of the float32 one) in three passes; head.h has the method.

#include "head.h"

#ifdef TANDEM_GREEDY_HEAD
namespace {

// Approximate logits of R rows x 16 columns (half a panel). ``xq``: the rows
// quantized, (q_x + kQuantOffset) as bytes, ``groups`` * 4 per row; ``panel``:
// int8 [groups, 32 columns, 4]; the offset's share (offset * column sum) comes off at
// the end, then the row and column scales.
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// With AVX512-VNNI, one vpdpbusd sums a group (4 k values) of all 16
// columns into their int32 lanes: 64 multiply-adds an instruction, exact
// integer sums of 8-bit rows (the AVX2 path below takes 6 bits, to keep its
// int16 pair sums from saturating; here there is none to fear).
template <int R>
void int8_rows_x16(const uint8_t* xq, int64_t ldx, const int8_t* panel, int64_t groups,
                   const int32_t* colsum, const float* col_scale, const RowQuant* rows,
                   float* out, int64_t ldo) {
  __m512i acc[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i b = _mm512_loadu_si512(panel + g * kPanel * kGroup);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * ldx + g * kGroup, sizeof four);
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(four), b);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) store_logits16(acc[r], colsum, col_scale, rows[r].scale, out + r * ldo);
}
#else
template <int R>
void int8_rows_x16(const uint8_t* xq, int64_t ldx, const int8_t* panel, int64_t groups,
                   const int32_t* colsum, const float* col_scale, const RowQuant* rows,
                   float* out, int64_t ldo) {
  __m256i acc[R][2];
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  // Two groups a pass: their int16 pair sums (each within 2 * 63 * 127)
  // added before one widening multiply-add ("groups" is even). That is 3
  // multiplying instructions per 64 multiply-adds where float32 FMAs take 8.
  for (int64_t g = 0; g < groups; g += 2) {
    const auto* q = reinterpret_cast<const __m256i*>(panel + g * kPanel * kGroup);
    const __m256i b0 = _mm256_loadu_si256(q), b1 = _mm256_loadu_si256(q + 1);
    const __m256i c0 = _mm256_loadu_si256(q + 4), c1 = _mm256_loadu_si256(q + 5);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t four[2];
      std::memcpy(four, xq + r * ldx + g * kGroup, sizeof four);
      const __m256i x = _mm256_set1_epi32(four[0]), y = _mm256_set1_epi32(four[1]);
      const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(x, b0), _mm256_maddubs_epi16(y, c0));
      const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(x, b1), _mm256_maddubs_epi16(y, c1));
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(s0, ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(s1, ones));
    }
  }
  const __m256i off = _mm256_set1_epi32(kQuantOffset);
  for (int c = 0; c < 2; ++c) {
    const __m256i shift =
        _mm256_mullo_epi32(off, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum + 8 * c)));
    const __m256 scale = _mm256_loadu_ps(col_scale + 8 * c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][c], shift));
      const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(rows[r].scale));
      _mm256_storeu_ps(out + r * ldo + 8 * c, _mm256_mul_ps(dot, s));
    }
  }
}
#endif

using Int8Tile = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*,
                          const float*, const RowQuant*, float*, int64_t);
constexpr int kInt8TileRows = 6;
constexpr Int8Tile kInt8Tiles[kInt8TileRows] = {int8_rows_x16<1>, int8_rows_x16<2>,
                                                 int8_rows_x16<3>, int8_rows_x16<4>,
                                                 int8_rows_x16<5>, int8_rows_x16<6>};

// Fills ``q`` and row ``out`` of the quantized rows.
void quantize_row(const float* x, int64_t k, uint8_t* out, int64_t padded, RowQuant& q) {
  float top = 0.f;
  for (int64_t p = 0; p < k; ++p) {
    if (!std::isfinite(x[p])) return;
    top = std::max(top, std::fabs(x[p]));
  }
  if (!(top > 0.f)) return;
  q.scale = top / kQuantMax;
  if (!std::isnormal(q.scale)) return;  // x / scale would overflow
  double norm2 = 0.0, error2 = 0.0;
  for (int64_t p = 0; p < k; ++p) {
    const float level = std::nearbyint(x[p] / q.scale);
    const float bound = kQuantMax;
    const int qi = static_cast<int>(std::min(std::max(level, -bound), bound));
    out[p] = static_cast<uint8_t>(qi + kQuantOffset);
    const double e = static_cast<double>(x[p]) - static_cast<double>(q.scale) * qi;
    norm2 += static_cast<double>(x[p]) * x[p];
    error2 += e * e;
  }
  for (int64_t p = k; p < padded; ++p) out[p] = kQuantOffset;
  if (!std::isfinite(norm2)) return;
  q.norm = std::sqrt(norm2);
  q.error = std::sqrt(error2);
  q.ok = true;
}

// Column j of the int8 copy times x (unquantized) in float32: within
// ||x|| (E_j + gamma_K W_j) of y_j, gamma_K covering this sum's own rounding.
float int8_column(const float* x, int64_t k, const int8_t* q8, int64_t groups, int64_t j,
                  float scale) {
  const int8_t* q = q8 + (j / kPanel) * groups * kPanel * kGroup + (j % kPanel) * kGroup;
  __m128 acc = _mm_setzero_ps();
  int64_t p = 0;
  for (; p + kGroup <= k; p += kGroup) {
    int32_t four;
    std::memcpy(&four, q + p / kGroup * kPanel * kGroup, sizeof four);
    const __m128 w = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
    acc = _mm_fmadd_ps(_mm_loadu_ps(x + p), w, acc);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, acc);
  float sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; p < k; ++p) sum += x[p] * q[p / kGroup * kPanel * kGroup + p % kGroup];
  return sum * scale;
}

// Slack for the float arithmetic of the approximate logits and their bounds
// (each a few roundings of 2^-24): relative to the bound and to the logit.
constexpr float kBoundSlack = 1.001f;
constexpr float kLogitSlack = 1e-5f;
// Columns the first screen may pass to the second (one int8 column each).
constexpr int64_t kMaxScreened = 1024;

// The screen in three passes: the int8 logits of quantized x (every column),
// then the int8 logits of x itself (the columns the first pass could not rule
// out), then the exact float32 sums (the columns the second could not).
int64_t screened_argmax_i8(const float* x, int64_t k, const float* approx, const RowQuant& q,
                        const float* col_scale, const float* err, const float* norm,
                        const int8_t* q8, int64_t groups, const float* panels, int64_t n,
                        int64_t max_candidates, std::vector<float>& span_top,
                        std::vector<int64_t>& first, std::vector<float>& second) {
  // First pass, 16 columns at a time: the highest lower bound (the floor)
  // and, per span of kSpan columns, the highest upper bound; then, in the
  // spans that reach the floor, every column whose upper bound does.
  // radius_i = (||x|| E_i + ||x - x~|| W_i) * kBoundSlack + kLogitSlack * |approx_i|.
  const float nxs = static_cast<float>(q.norm * (1.0 + 1e-9)) * kBoundSlack;
  const float exs = static_cast<float>(q.error * (1.0 + 1e-9)) * kBoundSlack + 1e-30f;
  auto radius = [&](int64_t i, Lanes16 y) {
    const Lanes16 abs_y = y < 0.f ? -y : y;
    return (nxs * load16(err + i) + exs * load16(norm + i)) + kLogitSlack * abs_y;
  };
  auto scalar_radius = [&](int64_t i) {
    return (nxs * err[i] + exs * norm[i]) + kLogitSlack * std::fabs(approx[i]);
  };
  constexpr int64_t kSpan = 256;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t whole = n / 16 * 16;
  const int64_t spans = (whole + kSpan - 1) / kSpan;
  span_top.resize(spans);
  Lanes16 lower = -kInf + Lanes16{};
  Ints16 finite = ~Ints16{};
  for (int64_t s = 0; s < spans; ++s) {
    Lanes16 upper = -kInf + Lanes16{};
    for (int64_t i = s * kSpan; i < std::min(whole, (s + 1) * kSpan); i += 16) {
      const Lanes16 y = load16(approx + i), r = radius(i, y);
      const Lanes16 low = y - r, up = y + r;
      lower = low > lower ? low : lower;
      upper = up > upper ? up : upper;
      finite &= (y < 0.f ? -y : y) < kInf;
    }
    span_top[s] = max_of(reinterpret_cast<const float*>(&upper), 16);
  }
  for (int i = 0; i < 16; ++i)
    if (finite[i] == 0) return -1;
  float floor_ = max_of(reinterpret_cast<const float*>(&lower), 16);
  for (int64_t i = whole; i < n; ++i) {
    if (!std::isfinite(approx[i])) return -1;
    floor_ = std::max(floor_, approx[i] - scalar_radius(i));
  }
  first.clear();
  for (int64_t s = 0; s < spans; ++s) {
    if (span_top[s] < floor_) continue;
    for (int64_t i = s * kSpan; i < std::min(whole, (s + 1) * kSpan); i += 16) {
      const Lanes16 y = load16(approx + i);
      const Ints16 reach = (y + radius(i, y)) >= floor_;
      for (int lane = 0; lane < 16; ++lane) {
        if (reach[lane] == 0) continue;
        if (static_cast<int64_t>(first.size()) >= kMaxScreened) return -1;
        first.push_back(i + lane);
      }
    }
  }
  for (int64_t i = whole; i < n; ++i) {
    if (approx[i] + scalar_radius(i) < floor_) continue;
    if (static_cast<int64_t>(first.size()) >= kMaxScreened) return -1;
    first.push_back(i);
  }
  // Second pass: radius ||x|| (E_j + gamma_K W_j), rounded up.
  const double unit = std::ldexp(1.0, -24);
  const float gamma = static_cast<float>(k * unit / (1 - k * unit) * 1.01);
  auto radius2 = [&](int64_t i, float y) {
    return nxs * (err[i] + gamma * norm[i]) + kLogitSlack * std::fabs(y);
  };
  second.resize(first.size());
  float floor2 = -std::numeric_limits<float>::infinity();
  for (size_t c = 0; c < first.size(); ++c) {
    const int64_t i = first[c];
    second[c] = int8_column(x, k, q8, groups, i, col_scale[i]);
    floor2 = std::max(floor2, second[c] - radius2(i, second[c]));
  }
  int64_t best = -1, count = 0;
  float top = 0.f;
  for (size_t c = 0; c < first.size(); ++c) {  // ascending columns
    const int64_t i = first[c];
    if (second[c] + radius2(i, second[c]) < floor2) continue;
    if (++count > max_candidates) return -1;
    const float y = exact_column(x, panels, k, i);
    if (!std::isfinite(y)) return -1;
    if (best < 0 || y > top) best = i, top = y;  // ascending i: the first of equals stays
  }
  return best;
}

}  // namespace

//   x:       [M, K] float32 rows (unit inner stride)
//   panels:  the head packed for linear(), [P, K, 32] float32
//   q8:      int8 [P, 2 * ceil(K / 8), 32, 4]: column j's quantized weights
//   colsum:  int32 [P * 32]: each column's sum of q8
//   columns: float32 [3, P * 32]: scale s_j, E_j, W_j (see above)
//   n:       columns that are tokens (the sampler's vocabulary size)
//   returns [M] int64: the greedy token of each row, or -1
at::Tensor greedy_head_i8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& q8,
                          const at::Tensor& colsum, const at::Tensor& columns, int64_t n,
                          int64_t max_candidates, [[maybe_unused]] bool amx_screen) {
  check_head(x, panels);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t num_panels = panels.size(0), ncols = num_panels * kPanel;
  const int64_t groups = (k + 2 * kGroup - 1) / (2 * kGroup) * 2, padded = groups * kGroup;
  TORCH_CHECK(q8.scalar_type() == at::kChar && q8.is_contiguous() &&
                  q8.sizes() == at::IntArrayRef({num_panels, groups, kPanel, kGroup}),
              "q8 must be contiguous int8 [", num_panels, ", ", groups, ", ", kPanel, ", ",
              kGroup, "]");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() &&
                  colsum.numel() == ncols,
              "colsum must be contiguous int32 [", ncols, "]");
  TORCH_CHECK(columns.scalar_type() == at::kFloat && columns.is_contiguous() &&
                  columns.sizes() == at::IntArrayRef({3, ncols}),
              "columns must be contiguous float32 [3, ", ncols, "]");
  TORCH_CHECK(n >= 1 && n <= ncols, "n = ", n, " is out of range");
  auto out = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return out;
  const float* a = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  std::vector<uint8_t> xq(static_cast<size_t>(m * padded));
  std::vector<RowQuant> quant(static_cast<size_t>(m));
  for (int64_t r = 0; r < m; ++r)
    quantize_row(a + r * lda, k, xq.data() + r * padded, padded, quant[r]);
  auto approx = at::empty({m, ncols}, x.options());
  float* ap = approx.data_ptr<float>();
  const auto* w8 = q8.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* scale = columns.data_ptr<float>();
  // Threads split the panels, then the rows, as linear() does.
  const int64_t grain = m * k * n < (1 << 21) ? num_panels : 1;
#ifdef TANDEM_AMX_SCREEN
  const bool use_amx = amx_screen && amx_usable();
#endif
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
#ifdef TANDEM_AMX_SCREEN
    if (use_amx) {
      int8_screen_amx(xq.data(), padded, m, w8, cs, scale, quant.data(), ap, ncols, begin, end);
      return;
    }
#endif
    for (int64_t t = begin; t < end; ++t) {
      for (int half_col = 0; half_col < kPanel; half_col += 16) {
        const int8_t* panel = w8 + t * groups * kPanel * kGroup + half_col * kGroup;
        const int64_t col = t * kPanel + half_col;
        for (int64_t i = 0; i < m; i += kInt8TileRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kInt8TileRows, m - i));
          kInt8Tiles[rows - 1](xq.data() + i * padded, padded, panel, groups, cs + col,
                               scale + col, quant.data() + i, ap + i * ncols + col, ncols);
        }
      }
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  const float* err = scale + ncols;
  const float* norm = scale + 2 * ncols;
  const float* w = panels.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> span_top;
    std::vector<int64_t> first;
    std::vector<float> second;
    for (int64_t r = begin; r < end; ++r)
      op[r] = quant[r].ok ? screened_argmax_i8(a + r * lda, k, ap + r * ncols, quant[r], scale,
                                               err, norm, w8, groups, w, n, max_candidates,
                                               span_top, first, second)
                          : -1;
  });
  return out;
}
#endif  // TANDEM_GREEDY_HEAD
