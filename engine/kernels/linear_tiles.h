// The linear kernel's register tiles over one panel of 32 float32 columns
// (linear.cpp), shared with the quantized kernels (quant_linear.cpp), which
// dequantize a panel into a buffer and run the same tiles over it.
#pragma once

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
[[maybe_unused]] inline const float* bias_data(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  check_f32(*bias, "bias");
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == n, "bias must be [", n, "]");
  return bias->data_ptr<float>();
}

// One tile of rows (``a``: its first) times ``cols`` columns of one panel
// into ``c`` (row stride ``ldc``); see each_tile for ``main`` and ``first``.
[[maybe_unused]] inline void panel_tile(const float* a, int64_t lda, int rows, bool main, bool first,
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
