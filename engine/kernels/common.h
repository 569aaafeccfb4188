// What every kernel file shares: ATen, the argument checks, the vector
// types and helpers used by more than one family, and the kernels that
// bindings.cpp exposes to Python.
//
// The kernels are float32 and follow the PyTorch reference in
// engine/models/llama.py and engine/attention.py operation for operation (no
// FMA contraction: built with -ffp-contract=off, except in the regions marked
// fp-contract=fast); only reduction order differs. engine/kernels/build.py
// compiles every .cpp file here into one extension, with the machine's ISA
// (-march=native) or the one TANDEM_KERNEL_ISA names; the preprocessor picks
// each kernel's branch from the ISA macros (isa.h lists them).
//
// Helpers live in an anonymous namespace, one copy per file, so that the
// compiler inlines them as it did when all the kernels were one file.
#pragma once

#include "isa.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

[[maybe_unused]] void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
}

// Rows [N, H] with unit inner stride; any row stride.
[[maybe_unused]] void check_rows(const at::Tensor& t, const char* name) {
  check_f32(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit stride");
}

// exp(x) to about 1.5 ulp in a form the compiler vectorises (Cody-Waite
// range reduction, Cephes' degree-6 polynomial); x is clamped to [-87, 88].
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(t < 0.f ? t - 0.5f : t + 0.5f);
  const float n = static_cast<float>(ni);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r) * r + r + 1.0f;
  return y * std::bit_cast<float>((ni + 127) << 23);
}

// 16 float lanes (GCC/Clang vector extensions: one AVX-512 register, or two
// AVX2 ones), and their halves and quarters.
typedef float Lanes16 __attribute__((vector_size(64)));
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));
typedef int32_t Ints16 __attribute__((vector_size(64)));  // a Lanes16 comparison

inline Lanes16 load16(const float* p) {
  Lanes16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The largest of s[0, m) (NaN ignored, as std::max(top, s[t]) does), 16
// lanes at a time: left to the compiler (an `omp simd` max reduction without
// -ffast-math) it became a chain of scalar max instructions, one value at a
// time (docs/cpu-kernels.md has the figures).
inline float max_of(const float* s, int64_t m) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  if (m >= 16) {
    Lanes16 a = load16(s), b = a;
    for (t = 16; t + 32 <= m; t += 32) {
      const Lanes16 x = load16(s + t), y = load16(s + t + 16);
      a = x > a ? x : a;
      b = y > b ? y : b;
    }
    for (; t + 16 <= m; t += 16) {
      const Lanes16 x = load16(s + t);
      a = x > a ? x : a;
    }
    a = b > a ? b : a;
    for (int i = 0; i < 16; ++i) top = std::max(top, a[i]);
  }
  for (; t < m; ++t) top = std::max(top, s[t]);
  return top;
}

// Columns per panel of a weight packed for the linear kernel (linear.cpp);
// engine.kernels.PANEL_WIDTH.
constexpr int kPanel = 32;

// Rows of x from which quant_linear dequantizes panels for the float32 tiles
// (fewer take its integer dot products); cpu_ops.QUANT_PANEL_ROWS.
constexpr int64_t kQuantPanelRows = 8;

}  // namespace

// The kernels, one family a file; bindings.cpp binds them.

// rows.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                        double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_store_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& positions, const at::Tensor& slots, at::Tensor& cache,
                   int64_t heads, int64_t kv_heads);
at::Tensor argmax_rows(const at::Tensor& x);

// decode_attention.cpp, prefill_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& tables, const at::Tensor& lens, double scale);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& cache,
                                   const at::Tensor& table, int64_t context, double scale);

// linear.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                  const std::optional<at::Tensor>& bias);
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t inter,
                           const std::optional<at::Tensor>& bias);

#ifdef TANDEM_GREEDY_HEAD
// head_f16.cpp, head_i8.cpp
at::Tensor greedy_head_f16(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& half,
                           const at::Tensor& bound, int64_t n, int64_t max_candidates);
at::Tensor greedy_head_i8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& q8,
                          const at::Tensor& colsum, const at::Tensor& columns, int64_t n,
                          int64_t max_candidates, bool amx_screen);
#endif
#ifdef TANDEM_AMX_SCREEN
// head_amx.cpp: whether Linux grants this process the AMX tile state.
bool amx_usable();
#endif

// quant_linear.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& scales, int64_t format, int64_t n,
                        const std::optional<at::Tensor>& bias, bool row_invariant);
// quant_dense.cpp: the [N, K] bfloat16 weights quantized blocks stand for.
at::Tensor quant_dense_bf16(const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                            int64_t format, int64_t k, const std::optional<at::Tensor>& out);
// quant_gemm.cpp: the integer GEMM for many rows, where the build has one for
// ``format`` (int8_gemm_supports): c [m, n] = x~ @ W^T, x quantized by rows.
bool int8_gemm_supports(int64_t format);
void int8_gemm(int64_t format, const float* a, int64_t lda, int64_t m, int64_t k,
               const uint8_t* w, const float* scales, int64_t n, float* c);
