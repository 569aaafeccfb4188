// The int8 screen's first pass (greedy_head_i8, head_i8.cpp) on AMX tiles:
// one tdpbusd sums 64 k values of up to 16 rows x 16 columns into an int32
// tile, the same exact sums as the vector path, 16 rows at the cost of about
// one. A process must ask Linux for the tile state first (arch_prctl); where
// it is refused (an old kernel, a signal stack too small for it) the vector
// path runs instead. Built only where the compiler targets AMX-INT8 and
// AVX512-VNNI (TANDEM_AMX_SCREEN).

#include "isa.h"

#ifdef TANDEM_AMX_SCREEN
#include "head.h"

#include <sys/syscall.h>
#include <unistd.h>

bool amx_usable() {
  static const bool usable = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return usable;
}

namespace {

// The tile registers: C (2, one per half panel), A (x, 64 k values), B
// (2, 16 groups of a half panel), and A and B again for the k tail.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig(int m, int tail_bytes) {
    for (int t : {0, 1, 2}) rows[t] = static_cast<uint8_t>(m), colsb[t] = 64;
    for (int t : {3, 4}) rows[t] = 16, colsb[t] = 64;
    if (tail_bytes > 0) {
      rows[5] = static_cast<uint8_t>(m), colsb[5] = static_cast<uint16_t>(tail_bytes);
      for (int t : {6, 7}) rows[t] = static_cast<uint8_t>(tail_bytes / kGroup), colsb[t] = 64;
    }
  }
};
static_assert(sizeof(TileConfig) == 64);

constexpr int kAmxRows = 16;
constexpr int64_t kGroupBytes = kPanel * kGroup;  // one group of all 32 columns

// C tiles 0 and 1 += x's k values from p (tile A) times both half panels'
// (tiles B0, B1): the shapes TileConfig gave those tiles decide how many.
// A macro: GCC's tile intrinsics spell their register numbers into inline
// assembly, so they take literals, not template parameters.
#define TANDEM_DPBUSD_CHUNK(A, B0, B1)                   \
  do {                                                   \
    const int8_t* b = panel + p / kGroup * kGroupBytes;  \
    _tile_loadd(A, xq + p, ldx);                         \
    _tile_loadd(B0, b, kGroupBytes);                     \
    _tile_loadd(B1, b + kGroupBytes / 2, kGroupBytes);   \
    _tile_dpbusd(0, A, B0);                              \
    _tile_dpbusd(1, A, B1);                              \
  } while (0)

// Approximate logits of m <= 16 rows x one panel (32 columns), the tiles
// configured by TileConfig(m, padded % 64). As int8_rows_x16 for the rest.
void int8_panel_amx(const uint8_t* xq, int64_t ldx, const int8_t* panel, int64_t padded, int m,
                    const int32_t* colsum, const float* col_scale, const RowQuant* rows,
                    float* out, int64_t ldo) {
  constexpr int64_t kChunk = 64;  // k values (bytes of x) a tile row holds
  _tile_zero(0);
  _tile_zero(1);
  int64_t p = 0;
  for (; p + kChunk <= padded; p += kChunk) TANDEM_DPBUSD_CHUNK(2, 3, 4);
  if (p < padded) TANDEM_DPBUSD_CHUNK(5, 6, 7);
#undef TANDEM_DPBUSD_CHUNK
  alignas(64) int32_t sums[kAmxRows][kPanel];
  _tile_stored(0, &sums[0][0], sizeof sums[0]);
  _tile_stored(1, &sums[0][16], sizeof sums[0]);
  for (int r = 0; r < m; ++r)
    for (int half = 0; half < kPanel; half += 16)
      store_logits16(_mm512_load_si512(&sums[r][half]), colsum + half, col_scale + half,
                     rows[r].scale, out + r * ldo + half);
}

}  // namespace

// The screen's first pass over panels [begin, end) with AMX.
void int8_screen_amx(const uint8_t* xq, int64_t padded, int64_t m, const int8_t* w8,
                     const int32_t* colsum, const float* col_scale, const RowQuant* quant,
                     float* approx, int64_t ncols, int64_t begin, int64_t end) {
  const int tail = static_cast<int>(padded % 64);
  for (int64_t i = 0; i < m; i += kAmxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, m - i));
    const TileConfig config(rows, tail);
    _tile_loadconfig(&config);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t col = t * kPanel;
      int8_panel_amx(xq + i * padded, padded, w8 + t * padded * kPanel, padded, rows, colsum + col,
                     col_scale + col, quant + i, approx + i * ncols + col, ncols);
    }
    _tile_release();
  }
}
#endif  // TANDEM_AMX_SCREEN
