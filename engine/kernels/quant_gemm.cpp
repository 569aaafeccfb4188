// The integer GEMM of quant_linear (quant_linear.cpp) for many rows (a
// prefill): x's rows quantized to int8 in blocks of 32 (quantize_rows, as the
// few-row path does) times the weights' bytes, on the CPU's int8 dot-product
// instructions (AVX512-VNNI vpdpbusd on 16 lanes, AVX-VNNI's on 8, AVX2's
// vpmaddubsw + vpmaddwd where the CPU has neither).
//
// Every format becomes one form when a panel of 32 output rows is packed:
// unsigned bytes u, a scale d and an offset m per block and output, with
// w = d u + m... for the 4-bit formats (u = q, m = Q4_1's min or -8 d), and
// w = d (u - 128) for the signed ones (u = q + 128, so m = -128 d). Then
//   y = sum_b  d_w d_x isum(u, x~)_b  +  m_w (d_x sum(x~))_b,
// with isum a block's 32 products summed in int32. The packed panel keeps a
// block's bytes in groups of 4 inputs a column ([8][32][4]), the layout
// vpdpbusd multiplies against 4 bytes of a row broadcast to every lane; a
// thread packs a panel once and passes every tile of rows over it, so each
// weight block is read from memory once per call.
//
// vpmaddubsw saturates its int16 pair sums: with 8-bit u (the signed formats)
// and x~ up to 127 they overflow, so an AVX2 CPU without VNNI takes this path
// for the 4-bit formats only (u <= 15) and quant_linear keeps the float32
// panels for the others (int8_gemm_supports). AMX (tdpbusd) is not used:
// the tiles need the process's tile state and a different packing, and no
// machine here has AMX to test it on.

#include "quant_blocks.h"

#if defined(__AVX2__)

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kIntLanes = 16;
constexpr int kGemmRows = 6;  // 12 int32 accumulators, 2 panel vectors
using IVec = __m512i;
using FVec = __m512;
inline IVec zero_i() { return _mm512_setzero_si512(); }
inline IVec load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline IVec dot4(IVec acc, IVec u, IVec s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline FVec to_f(IVec v) { return _mm512_cvtepi32_ps(v); }
inline FVec load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline FVec set1_f(float v) { return _mm512_set1_ps(v); }
inline FVec fma_f(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FVec mul_f(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
constexpr bool kAllFormats = true;
#else
constexpr int kIntLanes = 8;
constexpr int kGemmRows = 4;  // 8 int32 accumulators, 2 panel vectors (of 16 registers)
using IVec = __m256i;
using FVec = __m256;
inline IVec zero_i() { return _mm256_setzero_si256(); }
inline IVec load_i(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline IVec bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline IVec dot4(IVec acc, IVec u, IVec s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline FVec to_f(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline FVec set1_f(float v) { return _mm256_set1_ps(v); }
inline FVec fma_f(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FVec mul_f(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kAllFormats = true;
#else
constexpr bool kAllFormats = false;  // vpmaddubsw: 4-bit weights only
#endif
#endif

constexpr int kTileVecs = 2;  // vectors of columns a tile covers
constexpr int kTileCols = kTileVecs * kIntLanes;
constexpr int kGroups = kBlock / 4;  // of 4 inputs, a vpdpbusd each
static_assert(kPanel % kTileCols == 0);

// One block of a packed panel: u [8 groups][32 columns][4 inputs], d, m.
struct PackedBlock {
  alignas(64) uint8_t u[kGroups][kPanel][4];
  alignas(64) float d[kPanel], m[kPanel];
};

// Block b of output rows [first, first + cols) into ``out`` (columns past
// ``cols`` zero).
template <int F>
void pack_block(const uint8_t* w, int64_t row_bytes, const float* scales, int64_t first, int cols,
                int64_t b, PackedBlock& out) {
  alignas(32) uint8_t q[kBlock];
  for (int j = 0; j < kPanel; ++j) {
    float d = 0.f, min = 0.f;
    __m256i v = _mm256_setzero_si256();
    if (j < cols) {
      const uint8_t* p = w + (first + j) * row_bytes + b * kBlockBytes[F];
      v = load_q<F>(p, F == kInt8 ? scales[first + j] : 1.f, d, min);
      if constexpr (F <= kQ8_0) {  // signed q -> u = q + 128, w = d (u - 128)
        v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
        min = -128.f * d;
      }
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), v);
    for (int g = 0; g < kGroups; ++g) std::memcpy(out.u[g][j], q + 4 * g, 4);
    out.d[j] = d, out.m[j] = min;
  }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
// Rows [i0, i0 + R) of x times the kTileCols columns at ``col`` of a packed
// panel of nb blocks, into c (row stride ldc; ``cols`` of them written).
template <int R>
void gemm_tile(const RowBlocks& x, int64_t i0, int64_t nb, const PackedBlock* panel, int col,
               float* c, int64_t ldc, int cols) {
  FVec acc[R][kTileVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = set1_f(0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const PackedBlock& p = panel[b];
    IVec isum[R][kTileVecs];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < kTileVecs; ++v) isum[r][v] = zero_i();
#pragma GCC unroll 8
    for (int g = 0; g < kGroups; ++g) {
      IVec u[kTileVecs];
#pragma GCC unroll 2
      for (int v = 0; v < kTileVecs; ++v) u[v] = load_i(p.u[g][col + v * kIntLanes]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const IVec s = bcast4(x.q.data() + ((i0 + r) * nb + b) * kBlock + 4 * g);
#pragma GCC unroll 2
        for (int v = 0; v < kTileVecs; ++v) isum[r][v] = dot4(isum[r][v], u[v], s);
      }
    }
#pragma GCC unroll 2
    for (int v = 0; v < kTileVecs; ++v) {
      const FVec d = load_f(p.d + col + v * kIntLanes), m = load_f(p.m + col + v * kIntLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (i0 + r) * nb + b;
        acc[r][v] = fma_f(to_f(isum[r][v]), mul_f(d, set1_f(x.d[at])), acc[r][v]);
        acc[r][v] = fma_f(m, set1_f(x.sum[at]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[kTileCols];
    for (int v = 0; v < kTileVecs; ++v) store_f(row + v * kIntLanes, acc[r][v]);
    std::memcpy(c + r * ldc, row, std::max(0, std::min(cols, kTileCols)) * sizeof(float));
  }
}
#pragma GCC pop_options

using GemmTile = void (*)(const RowBlocks&, int64_t, int64_t, const PackedBlock*, int, float*,
                          int64_t, int);
template <int... Rs>
constexpr std::array<GemmTile, sizeof...(Rs)> gemm_tiles(std::integer_sequence<int, Rs...>) {
  return {&gemm_tile<Rs + 1>...};
}
constexpr auto kGemmTiles = gemm_tiles(std::make_integer_sequence<int, kGemmRows>{});

template <int F>
void gemm(const RowBlocks& x, int64_t m, int64_t nb, const uint8_t* w, const float* scales,
          int64_t n, float* c) {
  const int64_t row_bytes = nb * kBlockBytes[F], panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<PackedBlock> panel(nb);
    for (int64_t t = begin; t < end; ++t) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - t * kPanel));
      for (int64_t b = 0; b < nb; ++b)
        pack_block<F>(w, row_bytes, scales, t * kPanel, cols, b, panel[b]);
      for (int64_t i = 0; i < m; i += kGemmRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kGemmRows, m - i));
        for (int col = 0; col < cols; col += kTileCols)
          kGemmTiles[rows - 1](x, i, nb, panel.data(), col, c + i * n + t * kPanel + col, n,
                               cols - col);
      }
    }
  });
}

using Gemm = void (*)(const RowBlocks&, int64_t, int64_t, const uint8_t*, const float*, int64_t,
                      float*);
constexpr Gemm kGemms[4] = {&gemm<kInt8>, &gemm<kQ8_0>, &gemm<kQ4_0>, &gemm<kQ4_1>};

}  // namespace

bool int8_gemm_supports(int64_t format) { return kAllFormats || format >= kQ4_0; }

void int8_gemm(int64_t format, const float* a, int64_t lda, int64_t m, int64_t k,
               const uint8_t* w, const float* scales, int64_t n, float* c) {
  const int64_t nb = (k + kBlock - 1) / kBlock;
  kGemms[format](quantize_rows(a, lda, m, k, nb), m, nb, w, scales, n, c);
}

#else  // no AVX2: quant_linear keeps the float32 panels

bool int8_gemm_supports(int64_t) { return false; }

void int8_gemm(int64_t, const float*, int64_t, int64_t, int64_t, const uint8_t*, const float*,
               int64_t, float*) {
  TORCH_CHECK(false, "int8_gemm needs AVX2");
}

#endif
