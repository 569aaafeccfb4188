// Quantized weights dequantized into a dense bfloat16 matrix, for a matmul of
// many rows (a prefill, a large batch) on the CPU's matrix units: where the
// CPU has AMX-BF16, torch's bfloat16 matmul (oneDNN) runs on its tiles at
// 0.9-2.4 TFLOP/s on two cores here, 1.8-2.7x quant_linear's integer GEMM at
// 512 rows, dequantizing included (engine/quant.py decides when;
// docs/cpu-kernels.md). The matrix lives for one call: the
// weights stay quantized in memory.
//
// w = d q (+ m) in float32 (one fused multiply-add for the 4-bit formats,
// as quant_linear's float32 panels), then rounded to bfloat16 to nearest
// even.
//
// ``out``, where given, receives the matrix (a scratch buffer the caller
// keeps: a fresh allocation of tens of MB is mapped page by page, 14 ms for
// SmolLM2's 56 MB head against 3 ms to fill a mapped one).

#include "quant_blocks.h"

#include <c10/util/BFloat16.h>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// One block's 32 values from their bytes: signed or unsigned, times d, + min.
template <int F>
inline void dense_block(const uint8_t* p, float scale, int len, c10::BFloat16* out) {
  float d, min;
  const __m256i q = load_q<F>(p, scale, d, min);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m512i wlo = F <= kQ8_0 ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
  const __m512i whi = F <= kQ8_0 ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(min);
  const __m512 flo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wlo), vd, vm);
  const __m512 fhi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(whi), vd, vm);
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(fhi, flo));
  if (len == kBlock)
    _mm512_storeu_si512(out, both);
  else
    _mm512_mask_storeu_epi16(out, (__mmask32{1} << len) - 1, both);
}
#else
template <int F>
inline void dense_block(const uint8_t* p, float scale, int len, c10::BFloat16* out) {
  uint8_t nibbles[kBlock];
  float d, min;
  const uint8_t* q = block_q<F>(p, nibbles, d, min);
  if constexpr (F == kInt8) d = scale;
  for (int e = 0; e < len; ++e) {
    const float v = F <= kQ8_0 ? static_cast<float>(static_cast<int8_t>(q[e]))
                               : static_cast<float>(q[e]);
    out[e] = c10::BFloat16(std::fma(v, d, min));
  }
}
#endif

template <int F>
void dense(const uint8_t* w, const float* scales, int64_t n, int64_t k, c10::BFloat16* out) {
  const int64_t nb = (k + kBlock - 1) / kBlock, row_bytes = nb * kBlockBytes[F];
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, k));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float scale = F == kInt8 ? scales[j] : 1.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int len = static_cast<int>(std::min<int64_t>(kBlock, k - b * kBlock));
        dense_block<F>(w + j * row_bytes + b * kBlockBytes[F], scale, len,
                       out + j * k + b * kBlock);
      }
    }
  });
}

using Dense = void (*)(const uint8_t*, const float*, int64_t, int64_t, c10::BFloat16*);
constexpr Dense kDense[4] = {&dense<kInt8>, &dense<kQ8_0>, &dense<kQ4_0>, &dense<kQ4_1>};

}  // namespace

//   weight:  [N, ceil(K / 32) * block bytes] int8 or uint8, contiguous
//   scales:  [N] float32 for format 0 (int8), else None
//   out:     [N, K] bfloat16, contiguous, or None (a new tensor)
//   returns  [N, K] bfloat16: the weights the blocks stand for
at::Tensor quant_dense_bf16(const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                            int64_t format, int64_t k, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(format >= kInt8 && format <= kQ4_1, "unknown quantized format ", format);
  const int64_t nb = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.device().is_cpu() && weight.element_size() == 1 && weight.is_contiguous() &&
                  weight.dim() == 2 && weight.size(1) == nb * kBlockBytes[format],
              "weight must be contiguous 1-byte [N, ", nb * kBlockBytes[format], "] for format ",
              format, " and ", k, " inputs");
  const int64_t n = weight.size(0);
  const float* sp = row_scales(scales, format, n);
  at::Tensor dense;
  if (out.has_value()) {
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == at::kBFloat16 &&
                    out->is_contiguous() && out->dim() == 2 && out->size(0) == n &&
                    out->size(1) == k,
                "out must be contiguous bfloat16 [", n, ", ", k, "]");
    dense = *out;
  } else {
    dense = at::empty({n, k}, weight.options().dtype(at::kBFloat16));
  }
  if (n == 0 || k == 0) return dense;
  kDense[format](static_cast<const uint8_t*>(weight.data_ptr()), sp, n, k,
                 dense.data_ptr<c10::BFloat16>());
  return dense;
}
