// What the decode and prefill attention kernels share: the softmax of a row
// of scores and the head sizes they are compiled for.
#pragma once

#include "common.h"

namespace {

// exp_approx for x <= 0 (x - max in a softmax): one clamp, no sign test,
// and the polynomial in fused multiply-adds (std::fma vectorises to FMA
// instructions): about half the instructions of exp_approx's loop.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(t - 0.5f);  // t <= 0: rounds to nearest
  const float n = static_cast<float>(ni);
  const float r = std::fma(n, 2.12194440e-4f, std::fma(n, -0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p * r, r, r) + 1.0f;
  return y * std::bit_cast<float>((ni + 127) << 23);
}

// s[0, m) -> exp(s - max), s[m, ld) -> 0; returns the sum. The values up
// to the next multiple of 16 (<= ld) go through whole vectors: -inf in,
// exp(-87) out, lost in the sum, then zeroed. Kept outside the prefill
// kernel's fp-contract region: GCC does not inline across different
// optimize options, and a call per value is not vectorised.
float softmax_row(float* s, int64_t m, int64_t ld) {
  const int64_t m16 = (m + 15) / 16 * 16;
  std::fill(s + m, s + m16, -std::numeric_limits<float>::infinity());
  const float top = max_of(s, m16);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < m16; ++t) {
    s[t] = exp_nonpositive(s[t] - top);
    sum += s[t];
  }
  std::fill(s + m, s + ld, 0.f);  // past this row's position
  return sum;
}

// pick(std::integral_constant<int, D>) for the head size d: a size the
// kernels are compiled for, else D = 0 (the size read at run time).
template <typename Pick>
auto for_head_size(int64_t d, Pick pick) {
  switch (d) {
    case 16: return pick(std::integral_constant<int, 16>{});
    case 32: return pick(std::integral_constant<int, 32>{});
    case 64: return pick(std::integral_constant<int, 64>{});
    case 128: return pick(std::integral_constant<int, 128>{});
    case 256: return pick(std::integral_constant<int, 256>{});
    default: return pick(std::integral_constant<int, 0>{});
  }
}

}  // namespace
