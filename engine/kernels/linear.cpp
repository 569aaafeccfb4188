// Linear layers: x [M, K] times a weight packed in panels of 32 columns,
// [ceil(N / 32), K, 32] (engine.kernels.PackedWeight.pack). One panel's
// K x 32 floats are contiguous, so a panel streams linearly from memory and
// stays in L1/L2 while every row block of x passes over it; MKL instead
// repacks the [K, N] weight on each call, which costs as much as the
// arithmetic when M is a decode batch (docs/cpu-kernels.md has the figures).
// Each output is summed over k in order, with fused multiply-adds.

#include "common.h"

namespace {

// A tile is R rows of x times V vectors of panel columns, its R x V
// accumulators in registers. Main tiles cover whole groups of kTileRows
// rows; the rows left over take narrower-in-rows, full-panel tiles.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kTileRows = 12, kTileVecs = 2;  // 24 accumulators + 2 panel vectors
constexpr int kRestRows = 12, kRestVecs = 2;
#else
// AVX2 has 16 registers: 6 x 16 columns keeps 12 accumulators and the two
// panel vectors in registers (a 3 x 32 tile must read the panel from L1
// for every row, much slower at M >= 64). Few rows make too few
// accumulators to hide the FMA latency at 16 columns, hence 3 x 32 for them.
constexpr int kLanes = 8;
constexpr int kTileRows = 6, kTileVecs = 2;
constexpr int kRestRows = 3, kRestVecs = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

// Every loop over rows and vectors is unrolled in full: otherwise GCC keeps
// the accumulator array on the stack (an AVX2 build ran many times slower).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
// ``Stream``: the first tile over a panel reads it from L3 or memory (later
// ones find it in L1/L2), so it prefetches kPrefetchSteps k values ahead (at
// 8 and 16 rows the weights streamed faster so). With fewer than 4 rows the
// hardware keeps up unaided.
template <int R, int V, bool Stream>
void tile(const float* __restrict a, int64_t lda, const float* __restrict panel, int64_t k,
          const float* __restrict bias, float* __restrict c, int64_t ldc, int cols) {
  constexpr int64_t kPrefetchSteps = 32;  // 4 KB ahead
  Vec acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = (Vec){};
  for (int64_t p = 0; p < k; ++p) {
    Vec b[V];
    if constexpr (Stream && R >= 4) {  // one k value of a panel: two cache lines
      __builtin_prefetch(panel + (p + kPrefetchSteps) * kPanel, 0, 3);
      __builtin_prefetch(panel + (p + kPrefetchSteps) * kPanel + kPanel / 2, 0, 3);
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) std::memcpy(&b[v], panel + p * kPanel + v * kLanes, sizeof(Vec));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + p];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] += x * b[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[V * kLanes];
    for (int v = 0; v < V; ++v) std::memcpy(row + v * kLanes, &acc[r][v], sizeof(Vec));
    if (bias != nullptr)
      for (int j = 0; j < cols; ++j) row[j] += bias[j];
    std::memcpy(c + r * ldc, row, cols * sizeof(float));
  }
}
#pragma GCC pop_options

using Tile = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                      int);

template <bool Stream, int... Rs>
constexpr std::array<Tile, sizeof...(Rs)> rest_tiles(std::integer_sequence<int, Rs...>) {
  return {&tile<Rs + 1, kRestVecs, Stream>...};
}

// [stream]: see tile().
constexpr Tile kMainTile[2] = {&tile<kTileRows, kTileVecs, false>,
                               &tile<kTileRows, kTileVecs, true>};
constexpr int kMainCols = kTileVecs * kLanes;
constexpr std::array<Tile, kRestRows> kRestTiles[2] = {
    rest_tiles<false>(std::make_integer_sequence<int, kRestRows>{}),
    rest_tiles<true>(std::make_integer_sequence<int, kRestRows>{})};
static_assert(kPanel % kMainCols == 0 && kRestVecs * kLanes == kPanel);

// A linear kernel's optional bias of ``n`` floats, checked; nullptr for none.
const float* bias_data(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  check_f32(*bias, "bias");
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == n, "bias must be [", n, "]");
  return bias->data_ptr<float>();
}

// Rows of x per block: every panel passes over one block before the next, so
// that the block stays in L2 (kRowBlockBytes of it) instead of streaming all of
// x from L3 once per panel. A multiple of kTileRows, so only the last block
// has rows left over. The sums are the same (bit for bit); it pays off at
// prefill-sized batches (M in the thousands).
constexpr int64_t kRowBlockBytes = 256 << 10;

int64_t row_block(int64_t k) {
  const int64_t rows = kRowBlockBytes / (k * static_cast<int64_t>(sizeof(float)));
  return std::max<int64_t>(1, rows / kTileRows) * kTileRows;
}

// Calls f(t, i, rows, main, first) for every panel t in [begin, end) and
// every tile of rows [i, i + rows) of an [m, k] x, row block by row block:
// ``main`` for a full group of kTileRows rows, else the rows left over;
// ``first`` for a block's first tile over a panel (it reads the panel in).
template <class F>
void each_tile(int64_t m, int64_t k, int64_t begin, int64_t end, F f) {
  const int64_t block = row_block(k);
  for (int64_t i0 = 0; i0 < m; i0 += block) {
    const int64_t i1 = std::min(m, i0 + block);
    const int64_t full = i0 + (i1 - i0) / kTileRows * kTileRows;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = i0; i < i1;) {
        const bool main = i < full;
        const int rows =
            main ? kTileRows : static_cast<int>(std::min<int64_t>(kRestRows, i1 - i));
        f(t, i, rows, main, i == i0);
        i += rows;
      }
    }
  }
}

// One tile of rows (``a``: its first) times ``cols`` columns of one panel
// into ``c`` (row stride ``ldc``); see each_tile for ``main`` and ``first``.
inline void panel_tile(const float* a, int64_t lda, int rows, bool main, bool first,
                       const float* panel, int64_t k, const float* bias, float* c, int64_t ldc,
                       int cols) {
  if (!main) {
    kRestTiles[first][rows - 1](a, lda, panel, k, bias, c, ldc, cols);
    return;
  }
  for (int h = 0; h < cols; h += kMainCols)
    kMainTile[first && h == 0](a, lda, panel + h, k, bias == nullptr ? nullptr : bias + h, c + h,
                               ldc, std::min(kMainCols, cols - h));
}

}  // namespace

//   x:      [M, K] float32, unit stride within a row
//   panels: [ceil(N / 32), K, 32] contiguous (zero-padded past column N)
//   bias:   None or [N]
//   returns [M, N] = x @ W (+ bias)
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                  const std::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  check_f32(panels, "panels");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel,
              "panels must be contiguous [ceil(N / ", kPanel, "), K, ", kPanel, "]");
  TORCH_CHECK(panels.size(1) == k, "x has ", k, " columns, the weight ", panels.size(1), " rows");
  TORCH_CHECK(n >= 1 && (n + kPanel - 1) / kPanel == panels.size(0),
              "n = ", n, " does not match ", panels.size(0), " panels");
  const float* bp = bias_data(bias, n);
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const float* a = x.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t lda = x.stride(0);
  // Threads split the panels; a small product stays on one thread.
  const int64_t grain = m * k * n < (1 << 21) ? panels.size(0) : 1;
  at::parallel_for(0, panels.size(0), grain, [&](int64_t begin, int64_t end) {
    each_tile(m, k, begin, end, [&](int64_t t, int64_t i, int rows, bool main, bool first) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - t * kPanel));
      panel_tile(a + i * lda, lda, rows, main, first, w + t * k * kPanel, k,
                 bp == nullptr ? nullptr : bp + t * kPanel, c + i * n + t * kPanel, n, cols);
    });
  });
  return out;
}

// The MLP's first half: silu(x @ W_gate + b_gate) * (x @ W_up + b_up), each
// tile's gate and up sums (the same in-order sums as ``linear``) kept in
// L1 and combined as ``silu_mul`` combines them, so the result is the same
// bits as silu_mul(linear(x, gate_up)) without the [M, 2 * inter] product
// going through memory twice (faster at prefill-sized batches, the same
// at decode batches).
//   x:      [M, K] float32, unit stride within a row
//   panels: [2 * G, K, 32], G = ceil(inter / 32): the gate's panels, then the
//           up's (engine.kernels.PackedWeight.pack_gate_up)
//   bias:   None or [2 * G * 32], padded the same way
//   returns [M, inter]
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t inter,
                           const std::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  check_f32(panels, "panels");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t g = (inter + kPanel - 1) / kPanel;
  TORCH_CHECK(inter >= 1 && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(0) == 2 * g && panels.size(1) == k && panels.size(2) == kPanel,
              "panels must be contiguous [2 * ceil(inter / ", kPanel, "), K, ", kPanel, "]");
  const float* bp = bias_data(bias, 2 * g * kPanel);
  auto out = at::empty({m, inter}, x.options());
  if (m == 0) return out;
  const float* a = x.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t lda = x.stride(0);
  const int64_t grain = m * k * inter < (1 << 20) ? g : 1;
  static_assert(kRestRows <= kTileRows);
  at::parallel_for(0, g, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float gate[kTileRows * kPanel], up[kTileRows * kPanel];
    each_tile(m, k, begin, end, [&](int64_t t, int64_t i, int rows, bool main, bool first) {
      float* sums[2] = {gate, up};
      for (int half = 0; half < 2; ++half) {  // the gate's panel t, then the up's (g + t)
        const int64_t p = half * g + t;
        panel_tile(a + i * lda, lda, rows, main, first, w + p * k * kPanel, k,
                   bp == nullptr ? nullptr : bp + p * kPanel, sums[half], kPanel, kPanel);
      }
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, inter - t * kPanel));
      for (int r = 0; r < rows; ++r) {
        const float* gr = gate + r * kPanel;
        const float* ur = up + r * kPanel;
        float* o = c + (i + r) * inter + t * kPanel;
#pragma omp simd
        for (int j = 0; j < cols; ++j) o[j] = (gr[j] / (1.f + exp_approx(-gr[j]))) * ur[j];
      }
    });
  });
  return out;
}
