// What quant_linear.cpp's paths share: the block formats (engine.quant's
// QuantFormat codes and GGUF's block bytes) and their decoding, scalar and,
// where the compiler targets AVX2, in vectors.
#pragma once

#include "common.h"

#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum Format : int64_t { kInt8 = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_1 = 3 };
constexpr int kBlock = 32;
constexpr int64_t kBlockBytes[4] = {32, 34, 18, 20};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// The int8 format's float32 scale a row (checked: [n], contiguous), or
// nullptr for the formats that carry theirs in the blocks.
inline const float* row_scales(const std::optional<at::Tensor>& scales, int64_t format,
                               int64_t n) {
  if (format != kInt8) return nullptr;
  TORCH_CHECK(scales.has_value(), "format 0 (int8) needs scales");
  check_f32(*scales, "scales");
  TORCH_CHECK(scales->is_contiguous() && scales->numel() == n, "scales must be [", n, "]");
  return scales->data_ptr<float>();
}

// One weight block: its 32 q values (at ``q``; 4-bit ones unpacked into
// ``nibbles``), scale and min.
template <int F>
inline const uint8_t* block_q(const uint8_t* p, uint8_t* nibbles, float& d, float& min) {
  if constexpr (F == kInt8) {
    d = 1.f, min = 0.f;
    return p;
  } else if constexpr (F == kQ8_0) {
    d = half_at(p), min = 0.f;
    return p + 2;
  } else {
    d = half_at(p);
    const uint8_t* qs = p + (F == kQ4_1 ? 4 : 2);
    min = F == kQ4_1 ? half_at(p + 2) : -8.f * d;
    for (int j = 0; j < 16; ++j) nibbles[j] = qs[j] & 15, nibbles[j + 16] = qs[j] >> 4;
    return nibbles;
  }
}

// x's rows quantized in blocks: q [m, nb * 32], d and sum(x~) [m, nb]:
// x~ = round(x / d), d = max|x| / 127 a block (as llama.cpp's Q8 activations).
struct RowBlocks {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
};

inline RowBlocks quantize_rows(const float* a, int64_t lda, int64_t m, int64_t k, int64_t nb) {
  RowBlocks x{std::vector<int8_t>(m * nb * kBlock, 0), std::vector<float>(m * nb),
              std::vector<float>(m * nb)};
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, k));
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* row = a + i * lda + b * kBlock;
        const int len = static_cast<int>(std::min<int64_t>(kBlock, k - b * kBlock));
        float amax = 0.f;
        for (int j = 0; j < len; ++j) amax = std::max(amax, std::fabs(row[j]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q = x.q.data() + (i * nb + b) * kBlock;
        int total = 0;
        for (int j = 0; j < len; ++j) {
          q[j] = static_cast<int8_t>(std::nearbyint(row[j] * inv));
          total += q[j];
        }
        x.d[i * nb + b] = d;
        x.sum[i * nb + b] = d * static_cast<float>(total);
      }
    }
  });
  return x;
}

#if defined(__AVX2__)
inline __m256i dot_u8s8(__m256i u, __m256i s) {  // 8 int32 sums of 4 products each
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i unpack_q4(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One weight block's 32 q values (4-bit ones unpacked to bytes), its scale
// ``d`` (times ``scale``: int8's row scale) and min.
template <int F>
inline __m256i load_q(const uint8_t* p, float scale, float& d, float& min) {
  d = scale, min = 0.f;
  if constexpr (F == kInt8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else if constexpr (F == kQ8_0) {
    d = half_at(p);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  } else {
    d = half_at(p);
    min = F == kQ4_1 ? half_at(p + 2) : -8.f * d;
    return unpack_q4(p + (F == kQ4_1 ? 4 : 2));
  }
}

inline void transpose8(__m256* r) {  // an 8 x 8 block of floats, in registers
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

#endif  // __AVX2__

}  // namespace

