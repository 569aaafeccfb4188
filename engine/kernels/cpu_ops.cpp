// Fused CPU kernels for the decoder layer (float32).
//
// Each one replaces a chain of small ATen ops whose dispatch cost, not
// their arithmetic, dominates a decode step on CPU. The arithmetic follows
// the PyTorch reference in engine/models/llama.py and engine/attention.py
// operation for operation (no FMA contraction: built with
// -ffp-contract=off); only reduction order differs. engine/kernels/ builds
// this file on first use and falls back to the reference when it cannot.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>  // greedy_head only; other kernels use vector extensions
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
}

// Rows [N, H] with unit inner stride; any row stride.
void check_rows(const at::Tensor& t, const char* name) {
  check_f32(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit stride");
}

inline void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
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

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

}  // namespace

// weight * x / sqrt(mean(x^2) + eps), row by row: [N, H] -> new [N, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_f32(weight, "weight");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.numel() == h && weight.is_contiguous(), "weight must be [", h, "]");
  auto out = at::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, n, grain_rows(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(xp + r * xs, wp, op + r * h, h, static_cast<float>(eps));
  });
  return out;
}

// residual += delta (in place), then rms_norm(residual): the residual add
// that ends one sublayer fused with the norm that starts the next.
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  check_f32(weight, "weight");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  const int64_t n = residual.size(0), h = residual.size(1);
  TORCH_CHECK(delta.size(0) == n && delta.size(1) == h, "delta must match residual");
  TORCH_CHECK(weight.numel() == h && weight.is_contiguous(), "weight must be [", h, "]");
  auto out = at::empty({n, h}, residual.options());
  float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ds = delta.stride(0);
  at::parallel_for(0, n, grain_rows(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* row = rp + r * h;
      const float* d = dp + r * ds;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) row[i] = row[i] + d[i];
      rms_row(row, wp, op + r * h, h, static_cast<float>(eps));
    }
  });
  return out;
}

// silu(gate) * up over gate_up = [gate | up]: [N, 2I] -> new [N, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * inter, "gate_up must have an even width");
  auto out = at::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, n, grain_rows(inter), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = (g[i] / (1.f + exp_approx(-g[i]))) * u[i];
    }
  });
  return out;
}

// Rotary embedding (rotate-half) of the query and key heads of qkv, in
// place, then the keys and values written into their cache slots.
//   qkv:   [N, (heads + 2 * kv_heads) * head_dim], unit inner stride
//   cos, sin: [max_len, head_dim] tables; positions, slots: [N] int64
//   cache: one layer, [2, num_blocks, block_size, kv_heads, head_dim]
void rope_store_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& positions, const at::Tensor& slots, at::Tensor& cache,
                   int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  check_f32(cache, "cache");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5, "cache must be a contiguous 5-d layer");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "positions and slots must be int64");
  const int64_t d = cache.size(4), n = qkv.size(0);
  TORCH_CHECK(cache.size(3) == kv_heads, "cache has ", cache.size(3), " kv heads");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv width does not match the heads");
  TORCH_CHECK(cos.size(1) == d && d % 2 == 0, "cos must be [max_len, head_dim]");
  TORCH_CHECK(positions.numel() == n && slots.numel() == n, "one position and slot per row");
  const int64_t half = d / 2, max_len = cos.size(0);
  const int64_t num_slots = cache.size(1) * cache.size(2);
  const int64_t plane = num_slots * kv_heads * d;  // K and V planes of the layer
  auto pos = positions.contiguous();
  auto slt = slots.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slt.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(pp[r] >= 0 && pp[r] < max_len, "position ", pp[r], " out of range");
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "slot ", sp[r], " out of range");
  }
  float* qp = qkv.data_ptr<float>();
  float* kc = cache.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const int64_t qs = qkv.stride(0), rotated = heads + kv_heads;
  at::parallel_for(0, n, grain_rows(qs), [&](int64_t b, int64_t e) {
    std::vector<float> tmp(d);
    for (int64_t r = b; r < e; ++r) {
      float* row = qp + r * qs;
      const float* c = cp + pp[r] * d;
      const float* s = snp + pp[r] * d;
      for (int64_t h = 0; h < rotated; ++h) {
        float* x = row + h * d;
        for (int64_t i = 0; i < half; ++i) {
          // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
          tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
          tmp[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        std::copy(tmp.begin(), tmp.end(), x);
      }
      float* kdst = kc + sp[r] * kv_heads * d;
      std::copy(row + heads * d, row + rotated * d, kdst);
      std::copy(row + rotated * d, row + (rotated + kv_heads) * d, kdst + plane);
    }
  });
}

// Attention of one-token queries over their paged context.
namespace {

struct DecodeAttention {
  const float* q;       // [B, heads, d], row stride q_stride
  const float* keys;    // cache K plane: [num_blocks, bs, kv_heads, d]
  const float* values;  // cache V plane, same shape
  const int64_t* tables;
  const int64_t* lens;
  float* out;  // [B, heads * d]
  int64_t q_stride, width, bs, kv_heads, group, d;
  float scale;
};

// q . k over d values. With d a multiple of 16 known at compile time the
// products are summed in 16 lanes (GCC/Clang vector extensions: one AVX-512
// register, or two AVX2 ones) and the lanes as a tree; left to the compiler,
// the sum became a chain of 16 dependent scalar adds per dot, 4x slower.
typedef float Lanes16 __attribute__((vector_size(64)));
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));
typedef int32_t Ints16 __attribute__((vector_size(64)));  // a Lanes16 comparison

inline Lanes16 load16(const float* p) {
  Lanes16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The largest of s[0, m) (NaN ignored, as std::max(top, s[t]) does). GCC
// 12 with -march=native on an AVX-512 Xeon left the max reduction of an
// `omp simd` loop (no -ffast-math) as a chain of scalar vmaxss, 4 cycles a
// value: argmax_rows over 16 x 32000 took 0.85 ms (ATen's argmax: 0.87),
// 0.23 ms with this; decode attention over 16 x 300 tokens 15% less.
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

// Whether s[0, m) holds a NaN.
bool has_nan(const float* s, int64_t m) {
  Ints16 any = {};
  int64_t t = 0;
  for (; t + 16 <= m; t += 16) {
    const Lanes16 x = load16(s + t);
    any |= x != x;
  }
  bool nan = false;
  for (int i = 0; i < 16; ++i) nan |= any[i] != 0;
  for (; t < m; ++t) nan |= s[t] != s[t];
  return nan;
}

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

template <int D>
inline float dot(const float* q, const float* k, int64_t d) {
  if constexpr (D > 0 && D % 16 == 0) {
    Lanes16 acc = load16(q) * load16(k);
    for (int i = 16; i < D; i += 16) acc += load16(q + i) * load16(k + i);
    const Lanes8 s8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
    const Lanes4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) +
                      __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  } else {
    float sum = 0.f;
    for (int64_t i = 0; i < d; ++i) sum += q[i] * k[i];
    return sum;
  }
}

// Sixteen dots at once: q . k_j for the 16 keys k_0.. k_15 spaced ``stride``
// floats apart, returned as lane j. Each dot's 16 lanes are summed by the
// same tree as dot<D>, but the trees of all 16 run interleaved (15 shuffle
// pairs for 16 dots instead of 4 per dot), so the result is bit for bit
// the same as 16 calls of dot<D>.
template <int D>
inline Lanes16 dot16(const float* q, const float* k, int64_t stride) {
  static_assert(D > 0 && D % 16 == 0);
  Lanes16 qv[D / 16];
  for (int i = 0; i < D / 16; ++i) qv[i] = load16(q + 16 * i);
  Lanes16 acc[16];
  for (int j = 0; j < 16; ++j) {
    const float* kj = k + j * stride;
    acc[j] = qv[0] * load16(kj);
    for (int i = 1; i < D / 16; ++i) acc[j] += qv[i] * load16(kj + 16 * i);
  }
  Lanes16 u[8], v[4], w[2];
  for (int j = 0; j < 8; ++j)  // lanes i and i + 8
    u[j] = __builtin_shufflevector(acc[j], acc[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                   21, 22, 23) +
           __builtin_shufflevector(acc[j], acc[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                   27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)  // lanes i and i + 4
    v[j] = __builtin_shufflevector(u[j], u[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24,
                                   25, 26, 27) +
           __builtin_shufflevector(u[j], u[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28,
                                   29, 30, 31);
  for (int j = 0; j < 2; ++j)  // lanes i and i + 2
    w[j] = __builtin_shufflevector(v[j], v[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                   13, 28, 29) +
           __builtin_shufflevector(v[j], v[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                   15, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                                 30) +
         __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                                 31);
}

// Ask for a block's rows of kv heads [h0, h1) ahead of use: a sequence's
// blocks lie anywhere in the pool, so the hardware prefetcher loses the
// stream at every block edge (16 streams x 256 tokens: attention 2.3 ms a
// step without this).
inline void prefetch_rows(const float* base, int64_t count, int64_t row, int64_t h0, int64_t h1,
                          int64_t d) {
  for (int64_t j = 0; j < count; ++j) {
    const char* p = reinterpret_cast<const char*>(base + j * row + h0 * d);
    const char* end = reinterpret_cast<const char*>(base + j * row + h1 * d);
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 3);
  }
}

// One sequence's kv heads [h0, h1): each kv head's group of query heads
// over the context, block by block. A block's keys (or values) of all its kv
// heads are one contiguous run of memory, read once while every head here
// uses it. D > 0 fixes the head size at compile time, so the inner loops
// become a few whole vector instructions.
template <int D>
void attend(const DecodeAttention& a, int64_t b, int64_t h0, int64_t h1,
            std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t d = D > 0 ? D : a.d;
  const int64_t n = a.lens[b], group = a.group, rows = (h1 - h0) * group;
  const int64_t row = a.kv_heads * d, block = a.bs * row;
  const int64_t* table = a.tables + b * a.width;
  const float* qs = a.q + b * a.q_stride + h0 * group * d;  // this task's query rows
  const int64_t ld = (n + 15) / 16 * 16;  // score rows padded to whole vectors
  scores.resize(rows * ld);
  acc.assign(rows * d, 0.f);
  auto ahead = [&](const float* plane, int64_t t0) {  // the block from token t0
    if (t0 < n) prefetch_rows(plane + table[t0 / a.bs] * block, std::min(a.bs, n - t0), row, h0, h1, d);
  };
  for (int64_t t0 = 0; t0 < n; t0 += a.bs) {
    const int64_t count = std::min(a.bs, n - t0), bi = t0 / a.bs;
    const float* kb = a.keys + table[bi] * block;
    ahead(a.keys, t0 + a.bs);
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - h0) * group + g;
        const float* q = qs + r * d;
        float* s = scores.data() + r * ld + t0;
        const float* k = kb + h * d;
        int64_t j = 0;
        if constexpr (D > 0 && D % 16 == 0) {
          for (; j + 16 <= count; j += 16) {
            const Lanes16 s16 = dot16<D>(q, k + j * row, row) * a.scale;
            std::memcpy(s + j, &s16, sizeof s16);
          }
        }
        for (; j < count; ++j) s[j] = dot<D>(q, k + j * row, d) * a.scale;
      }
    }
  }
  ahead(a.values, 0);
  std::vector<float> total(rows);
  for (int64_t r = 0; r < rows; ++r) total[r] = softmax_row(scores.data() + r * ld, n, ld);
  for (int64_t t0 = 0; t0 < n; t0 += a.bs) {
    const int64_t count = std::min(a.bs, n - t0), bi = t0 / a.bs;
    const float* vb = a.values + table[bi] * block;
    ahead(a.values, t0 + a.bs);
    for (int64_t j = 0; j < count; ++j) {
      for (int64_t h = h0; h < h1; ++h) {
        const float* v = vb + j * row + h * d;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = (h - h0) * group + g;
          const float p = scores[r * ld + t0 + j];
          float* out = acc.data() + r * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) out[i] += p * v[i];
        }
      }
    }
  }
  float* o = a.out + b * a.kv_heads * group * d + h0 * group * d;
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / total[r];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[r * d + i] = acc[r * d + i] * inv;
  }
}

}  // namespace

//   q:      [B, heads, head_dim], unit stride within a row
//   cache:  one layer, [2, num_blocks, block_size, kv_heads, head_dim]
//   tables: [B, width] int64 block ids; lens: [B] int64 context lengths
//   returns [B, heads * head_dim]
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& tables, const at::Tensor& lens,
                                  double scale) {
  check_f32(q, "q");
  check_f32(cache, "cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [B, heads, head_dim] with contiguous rows");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5, "cache must be a contiguous 5-d layer");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "tables and lens must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t num_blocks = cache.size(1), bs = cache.size(2), kv_heads = cache.size(3);
  TORCH_CHECK(cache.size(4) == d, "cache head_dim ", cache.size(4), " != ", d);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch,
              "one table row and one length per query");
  auto tab = tables.contiguous();
  auto len = lens.contiguous();
  const int64_t width = tab.size(1);
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "context length ", lp[b], " out of range");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * width + j] >= 0 && tp[b * width + j] < num_blocks, "block id out of range");
  }
  auto out = at::empty({batch, heads * d}, q.options());
  const float* kbase = cache.data_ptr<float>();
  const DecodeAttention a{q.data_ptr<float>(), kbase, kbase + num_blocks * bs * kv_heads * d,
                          tp, lp, out.data_ptr<float>(), q.stride(0), width, bs, kv_heads,
                          heads / kv_heads, d, static_cast<float>(scale)};
  const auto run = for_head_size(d, [](auto D) { return &attend<decltype(D)::value>; });
  // Waking a second thread costs more than a short context's whole attention.
  // A task is one sequence, all its kv heads (their keys are contiguous);
  // with fewer sequences than threads, one (sequence, kv head).
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) work += lp[b];
  const int64_t split = batch < at::get_num_threads() ? kv_heads : 1;
  const int64_t tasks = batch * split, per = kv_heads / split;
  const int64_t grain = work * kv_heads < 16384 ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / split, h0 = task % split * per;
      run(a, b, h0, h0 + per, scores, acc);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------
// Prefill attention: the query rows of one prompt (or prompt chunk) over its
// paged context, causal: the row at position context + i sees keys
// [0, context + i]. Each kv head's keys are first laid out in 16-key tiles,
// transposed, so a query row's 16 scores are d multiply-adds of a broadcast
// query value and a tile row, eight rows at a time. A task is one kv head
// and up to kPrefillPositions positions (all their query heads); two passes,
// as the decode kernel: scores and softmax, then the values, up to four
// rows at a time. The multiply-adds are fused (FMA): the result is within
// float32 rounding of the PyTorch path, not equal to it bit for bit. One
// thread, 32-wide heads, 8/4 heads: 0.58 ms against SDPA's 0.76 at 256
// tokens, 1.9 vs 2.7 at 512, even at 2048, 0.69x at 4096 (each row's
// scores over the whole context leave the cache): engine/attention.py
// takes it up to FUSED_PREFILL_MAX_KEYS.
namespace {

constexpr int64_t kPrefillPositions = 16;
constexpr int kScoreRows = 8;

struct PrefillAttention {
  const float* q;       // [t, heads, d], row stride q_stride
  const float* keys;    // cache K plane: [num_blocks, bs, kv_heads, d]
  const float* values;  // cache V plane, same shape
  // Where token j's row (all kv heads) starts in a plane, for j < context + t:
  // its block table read once per call.
  const int64_t* token_at;
  float* out;  // [t, heads * d]
  int64_t q_stride, context, kv_heads, group, d;
  float scale;
  // Each kv head's keys in 16-key tiles, transposed: [kv_heads, tiles, d, 16].
  float* tiles;
  int64_t tiles_per_head;
};

// Tile i of kv head h: keys 16i.. 16i + 15 (the last one repeated past n).
void transpose_tile(const PrefillAttention& a, int64_t h, int64_t i, int64_t n) {
  float* tile = a.tiles + (h * a.tiles_per_head + i) * a.d * 16;
  for (int64_t c = 0; c < 16; ++c) {
    const float* k = a.keys + a.token_at[std::min(16 * i + c, n - 1)] + h * a.d;
    for (int64_t p = 0; p < a.d; ++p) tile[p * 16 + c] = k[p];
  }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
template <int D>
void prefill_task(const PrefillAttention& a, int64_t h, int64_t p0, int64_t p1,
                  std::vector<float>& scores) {
  const int64_t d = D > 0 ? D : a.d;
  const int64_t group = a.group, rows = (p1 - p0) * group, heads = a.kv_heads * group;
  const int64_t n = a.context + p1;  // keys the last position sees
  const int64_t ld = (n + 15) / 16 * 16;
  const float* values = a.values + h * d;  // this kv head's value in each token's row
  scores.resize(rows * ld);
  // Row r: position p0 + r / group, query head h * group + r % group.
  auto query = [&](int64_t r) {
    return a.q + (p0 + r / group) * a.q_stride + (h * group + r % group) * d;
  };
  auto seen = [&](int64_t r) { return a.context + p0 + r / group + 1; };
  const float* tiles = a.tiles + h * a.tiles_per_head * d * 16;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const float* tile = tiles + j0 * d;
    // Rows that see none of this tile (the first positions of a long tile
    // run) are skipped; the softmax below ignores what they would hold.
    int64_t r_begin = 0;
    while (r_begin < rows && seen(r_begin) <= j0) ++r_begin;
    for (int64_t r0 = r_begin; r0 < rows; r0 += kScoreRows) {
      const float* qs[kScoreRows];
      for (int i = 0; i < kScoreRows; ++i) qs[i] = query(std::min(r0 + i, rows - 1));
      Lanes16 acc[kScoreRows] = {};
      for (int64_t p = 0; p < d; ++p) {
        const Lanes16 kv = load16(tile + p * 16);
#pragma GCC unroll 8
        for (int i = 0; i < kScoreRows; ++i) acc[i] += qs[i][p] * kv;
      }
      for (int i = 0; i < kScoreRows && r0 + i < rows; ++i) {
        const Lanes16 s = acc[i] * a.scale;
        std::memcpy(scores.data() + (r0 + i) * ld + j0, &s, sizeof s);
      }
    }
  }
  std::vector<float> inv(rows);
  for (int64_t r = 0; r < rows; ++r) inv[r] = 1.f / softmax_row(scores.data() + r * ld, seen(r), ld);
  auto target = [&](int64_t r) {
    return a.out + (p0 + r / group) * heads * d + (h * group + r % group) * d;
  };
  if constexpr (D > 0 && D % 16 == 0) {
    constexpr int V = D / 16;
    constexpr int R = V >= 8 ? 1 : V >= 4 ? 2 : 4;  // R x V accumulators
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t nr = std::min<int64_t>(R, rows - r0);
      const int64_t m = seen(r0 + nr - 1);  // the last row sees the most keys
      const float* ps[R];
      for (int i = 0; i < R; ++i) ps[i] = scores.data() + std::min(r0 + i, rows - 1) * ld;
      Lanes16 acc[R][V] = {};
      for (int64_t j = 0; j < m; ++j) {
        const float* v = values + a.token_at[j];
        Lanes16 vv[V];
#pragma GCC unroll 8
        for (int u = 0; u < V; ++u) vv[u] = load16(v + 16 * u);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const float p = ps[i][j];
#pragma GCC unroll 8
          for (int u = 0; u < V; ++u) acc[i][u] += p * vv[u];
        }
      }
      for (int i = 0; i < nr; ++i) {
        float* o = target(r0 + i);
        for (int u = 0; u < V; ++u) {
          const Lanes16 y = acc[i][u] * inv[r0 + i];
          std::memcpy(o + 16 * u, &y, sizeof y);
        }
      }
    }
  } else {
    std::vector<float> acc(d);
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const float* s = scores.data() + r * ld;
      for (int64_t j = 0, m = seen(r); j < m; ++j) {
        const float* v = values + a.token_at[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[i] += s[j] * v[i];
      }
      float* o = target(r);
      for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv[r];
    }
  }
}
#pragma GCC pop_options

}  // namespace

//   q:       [t, heads, head_dim], unit stride within a row
//   cache:   one layer, [2, num_blocks, block_size, kv_heads, head_dim],
//            holding the context and these t tokens' keys and values
//   table:   [>= ceil((context + t) / block_size)] int64 block ids
//   returns  [t, heads * head_dim]
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& cache,
                                   const at::Tensor& table, int64_t context, double scale) {
  check_f32(q, "q");
  check_f32(cache, "cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [t, heads, head_dim] with contiguous rows");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5, "cache must be a contiguous 5-d layer");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1, "table must be 1-d int64");
  const int64_t t = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t num_blocks = cache.size(1), bs = cache.size(2), kv_heads = cache.size(3);
  TORCH_CHECK(cache.size(4) == d, "cache head_dim ", cache.size(4), " != ", d);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(context >= 0, "context must be >= 0");
  auto tab = table.contiguous();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t used = (context + t + bs - 1) / bs;
  TORCH_CHECK(tab.numel() >= used, "table has ", tab.numel(), " blocks, ", used, " needed");
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(tp[j] >= 0 && tp[j] < num_blocks, "block id out of range");
  auto out = at::empty({t, heads * d}, q.options());
  if (t == 0) return out;
  const float* kbase = cache.data_ptr<float>();
  const int64_t n = context + t, per_head = (n + 15) / 16;
  // Scratch kept by each thread across calls: fresh buffers of this size
  // come from mmap, and their page faults cost as much as the arithmetic.
  thread_local std::vector<float> tiles;
  thread_local std::vector<int64_t> token_at;
  tiles.resize(kv_heads * per_head * d * 16);
  token_at.resize(n);
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b)
    for (int64_t j = j0; j < std::min(n, j0 + bs); ++j)
      token_at[j] = (tp[b] * bs + j - j0) * kv_heads * d;
  const PrefillAttention a{q.data_ptr<float>(), kbase, kbase + num_blocks * bs * kv_heads * d,
                           token_at.data(), out.data_ptr<float>(), q.stride(0), context,
                           kv_heads, heads / kv_heads, d, static_cast<float>(scale),
                           tiles.data(), per_head};
  at::parallel_for(0, kv_heads * per_head, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) transpose_tile(a, i / per_head, i % per_head, n);
  });
  const auto run = for_head_size(d, [](auto D) { return &prefill_task<decltype(D)::value>; });
  const int64_t spans = (t + kPrefillPositions - 1) / kPrefillPositions;
  // Later spans see more keys: they go first, so threads end together.
  at::parallel_for(0, spans * kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t span = spans - 1 - task / kv_heads, h = task % kv_heads;
      const int64_t p0 = span * kPrefillPositions;
      run(a, h, p0, std::min(t, p0 + kPrefillPositions), scores);
    }
  });
  return out;
}

// Index of the largest value of each row (the first on ties; NaN counts as
// largest, as torch.argmax): [B, V] -> [B] int64.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t batch = x.size(0), v = x.size(1);
  TORCH_CHECK(v >= 1, "rows must not be empty");
  auto out = at::empty({batch}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, batch, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * xs;
      // Pass 1: the maximum (NaN ignored), and whether any value is NaN.
      const float top = max_of(row, v);
      const bool nan = has_nan(row, v);
      // Pass 2: the first index that holds it.
      int64_t idx = 0;
      for (int64_t i = 0; i < v; ++i) {
        if (nan ? row[i] != row[i] : row[i] == top) {
          idx = i;
          break;
        }
      }
      op[r] = idx;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------
// Linear layers: x [M, K] times a weight packed in panels of 32 columns,
// [ceil(N / 32), K, 32] (engine.kernels.pack_weight). One panel's K x 32
// floats are contiguous, so a panel streams linearly from memory and stays
// in L1/L2 while every row block of x passes over it; MKL instead repacks
// the [K, N] weight on each call, which costs as much as the arithmetic when
// M is a decode batch (a 32k-vocabulary head at M = 16: 6.0 ms vs 3.0 ms with
// AVX-512; 7.5 ms vs 5.2 ms with AVX2).
// Each output is summed over k in order, with fused multiply-adds.

namespace {

constexpr int kPanel = 32;
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
// for every row: 1.6-1.7x slower at M >= 64). Few rows make too few
// accumulators to hide the FMA latency at 16 columns, hence 3 x 32 for them.
constexpr int kLanes = 8;
constexpr int kTileRows = 6, kTileVecs = 2;
constexpr int kRestRows = 3, kRestVecs = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

// Every loop over rows and vectors is unrolled in full: otherwise GCC keeps
// the accumulator array on the stack (an AVX2 build ran 15x slower so).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
// ``Stream``: the first tile over a panel reads it from L3 or memory (later
// ones find it in L1/L2), so it prefetches kPrefetchSteps k values ahead: at
// 8 and 16 rows the layers' weights streamed at 21 and 15 GB/s without, 24
// and 17 with. With fewer than 4 rows the hardware keeps up unaided.
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
// has rows left over. The sums are the same (bit for bit). On a 2-core Xeon
// (2 MB L2) at M = 2048, best of 5: the default model's qkv 113 -> 131
// GFLOP/s, o 118 -> 143, down 121 -> 138, gate_up 106 -> 105; M <= 512 as
// before.
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
// going through memory twice. The default model's MLP on a 2-core Xeon,
// weights evicted between calls (medians): 0.76x the time of the two calls
// at M = 2048, 0.91-0.96x at 256, the same from 1 to 64 rows.
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

// ---------------------------------------------------------------------------
// Greedy tokens from the head without the full float32 logits.
//
// At a small decode batch the head's matmul streams its weight (32k x 256
// floats, 32 MB, for the default model) from memory; at a larger one it is
// the step's largest block of arithmetic. A screen reads a smaller copy of
// the head for approximate logits and bounds each one's distance from the
// float32 logit y_i the linear kernel would give. Every column whose
// interval can reach the highest lower bound is a candidate; the argmax is
// one of them. Candidates get the linear kernel's exact sum (the same
// in-order FMAs, so the same bits), and the first largest wins, as
// argmax_rows. A row whose candidates exceed ``max_candidates``, or with a
// value that is not finite, gets -1: the caller computes its logits in full.
//
// greedy_head_f16 reads a float16 copy (half the bytes):
//   |y~_i - y_i| <= ||x|| bound_i, bound_i (engine.kernels.HalfHead) being
//   ||w_i - w~_i|| plus the float32 rounding of both sums.
//
// greedy_head_i8 reads an int8 copy (a quarter of the bytes; AVX2's
// vpmaddubsw does 32 multiply-adds an instruction, AVX512-VNNI's vpdpbusd
// 64, an AMX tdpbusd 16K). With w~_i = s_i q_i the column quantized
// (engine.kernels.Int8Head) and x~ = s_x q_x the row quantized here (8 bits
// where the sums are int32, 6 bits for AVX2, |q_x| <= 31, so that four
// products sum in int16):
//   |x~ . w~_i - y_i| <= ||x|| E_i + ||x - x~|| W_i,
// E_i = ||w_i - w~_i|| plus the float32 rounding of y_i (gamma_K ||w_i||),
// W_i = ||w~_i||. The integer sums are exact; the float arithmetic that
// scales them and the bound gets a relative slack. Three passes per row:
//   1. every column's x~ . w~_i, the test above (tens of the default model's
//      32k columns pass, a few hundred at most in our runs);
//   2. for those, x . w~_i from the int8 column and x itself, within
//      ||x|| (E_i + gamma_K W_i): the row quantization's share is gone, and
//      the same test leaves 1 to 7 (more than kMaxScreened after pass 1: -1);
//   3. for those, the exact sums.
// The row quantization's share of the bound grows with sqrt(K) against the
// spread of the logits, so the int8 screen suits narrow models only (the
// engine takes it up to a hidden size of 512 with 6-bit rows, 2048 with 8,
// engine.kernels.INT8_MAX_HIDDEN).

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
namespace {

// Column j of a packed weight times x, as the linear kernel sums it.
float exact_column(const float* x, const float* panels, int64_t k, int64_t j) {
  const float* w = panels + (j / kPanel) * k * kPanel + j % kPanel;
  float acc = 0.f;
  for (int64_t p = 0; p < k; ++p) acc = std::fma(x[p], w[p * kPanel], acc);
  return acc;
}

// ---- the float16 screen ----

#if defined(__AVX512F__)
// AVX-512: R rows (up to 12) times a whole panel, 2R accumulators and the two
// converted panel vectors in registers. The AVX2 tiles below ran at half the
// width of the linear kernel's, so past 2 rows the screen cost more than the
// float32 logits it saves (2560 x 32000 at 16 rows: 28.3 ms against 14.5).
constexpr int kHalfTileRows = 12;
// Past this many rows the screen is compute-bound and costs more than the
// float32 logits (2560 x 32000: 0.98x of them at 4 rows, 1.20x at 8, 1.19x
// at 32; 4096 x 32000: 0.96x, 1.46x, 1.33x): the engine computes those.
constexpr int64_t kHalfScreenMaxRows = 4;

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
// At the linear kernel's width, the screen cost at most 1.04x the float32
// logits up to 32 rows (an AVX2 build, 576 x 49152 and 2560 x 32000).
constexpr int64_t kHalfScreenMaxRows = std::numeric_limits<int32_t>::max();

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
// instead of once for 2 (the head at 16 rows: 4.5 -> 4.2 ms here).
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

// ---- the int8 screen ----

constexpr int kGroup = 4;  // k values per int8 group (one int32 lane)
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// vpdpbusd and tdpbusd sum their products in int32: x takes 8 bits, and the
// row quantization's share of the first pass's bound is a quarter of 6 bits'.
constexpr int kQuantMax = 127;
constexpr int kQuantOffset = 128;
#else
constexpr int kQuantMax = 31;  // |q_x|: 4 products of u8 (q_x + 32) and s8 fit int16
constexpr int kQuantOffset = 32;
#endif

// One row quantized: (q_x + kQuantOffset) bytes (zero padding quantizes to
// the offset and meets zero weights), its scale, ||x|| and ||x - x~||. ``ok`` is false when
// the row is zero or not finite (the screen cannot settle it).
struct RowQuant {
  float scale = 0.f;
  double norm = 0.0, error = 0.0;
  bool ok = false;
};

// Approximate logits of R rows x 16 columns (half a panel). ``xq``: the rows
// quantized, (q_x + kQuantOffset) as bytes, ``groups`` * 4 per row; ``panel``:
// int8 [groups, 32 columns, 4]; the offset's share (offset * column sum) comes off at
// the end, then the row and column scales.
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// 16 columns' int32 sums of a row -> its approximate logits at ``out``: the
// offset's share off, then the column and row scales.
inline void store_logits16(__m512i sums, const int32_t* colsum, const float* col_scale,
                           float row_scale, float* out) {
  const __m512i shift = _mm512_mullo_epi32(_mm512_set1_epi32(kQuantOffset),
                                           _mm512_loadu_si512(colsum));
  const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, shift));
  const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(col_scale), _mm512_set1_ps(row_scale));
  _mm512_storeu_ps(out, _mm512_mul_ps(dot, s));
}

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

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
// With AMX (its sums stored through store_logits16), one tdpbusd sums 64 k values of up to 16 rows x 16 columns into
// an int32 tile: the same exact sums again, 16 rows at the cost of about one.
// A process must ask Linux for the tile state first (arch_prctl); where it
// is refused (an old kernel, a signal stack too small for it) the vector
// path above runs instead.
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return usable;
}

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
#define TANDEM_AMX_SCREEN 1
#endif

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

// Rows x [M, K] and a head packed for linear() over K inputs.
void check_head(const at::Tensor& x, const at::Tensor& panels) {
  check_rows(x, "x");
  check_f32(panels, "panels");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel &&
                  panels.size(1) == x.size(1),
              "panels must be contiguous [P, ", x.size(1), ", ", kPanel, "]");
}

}  // namespace

//   x:      [M, K] float32 rows (unit inner stride)
//   panels: the head packed for linear(), [ceil(N / 32), K, 32] float32
//   half:   the same values as float16, same shape
//   bound:  [>= n] float64, per column (see above)
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

//   x:       [M, K] float32 rows (unit inner stride)
//   panels:  the head packed for linear(), [P, K, 32] float32
//   q8:      int8 [P, 2 * ceil(K / 8), 32, 4]: column j's quantized weights
//   colsum:  int32 [P * 32]: each column's sum of q8
//   columns: float32 [3, P * 32]: scale s_j, E_j, W_j (see above)
//   n:       columns that are tokens (the sampler's vocabulary size)
//   returns [M] int64: the greedy token of each row, or -1
at::Tensor greedy_head_i8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& q8,
                          const at::Tensor& colsum, const at::Tensor& columns, int64_t n,
                          int64_t max_candidates, bool amx_screen) {
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
#define TANDEM_GREEDY_HEAD 1
#endif

// The kernels release the GIL, as ATen ops do: a worker's KV-receive and
// output threads keep running while a step's attention is computed.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm", &rms_norm, "RMSNorm over rows", release());
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; RMSNorm(residual)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release());
  m.def("linear_silu_mul", &linear_silu_mul, "silu(x @ W_gate + b) * (x @ W_up + b), packed",
        py::arg("x"), py::arg("panels"), py::arg("inter"), py::arg("bias") = py::none(), release());
  m.def("rope_store_kv", &rope_store_kv, "rotary embedding in place; store K and V", release());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged KV",
        release());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention over paged KV", release());
  m.def("argmax_rows", &argmax_rows, "argmax of each row", release());
  m.def("linear", &linear, "x @ W (+ bias), W packed in panels", py::arg("x"), py::arg("panels"),
        py::arg("n"), py::arg("bias") = py::none(), release());
#ifdef TANDEM_GREEDY_HEAD
  m.def("greedy_head_f16", &greedy_head_f16, "greedy tokens from a float16 screen of the head",
        release());
  m.def("greedy_head_i8", &greedy_head_i8, "greedy tokens from an int8 screen of the head",
        py::arg("x"), py::arg("panels"), py::arg("q8"), py::arg("colsum"), py::arg("columns"),
        py::arg("n"), py::arg("max_candidates"), py::arg("amx") = true, release());
#endif
#ifdef TANDEM_AMX_SCREEN
  m.def("amx_screen", &amx_usable, "whether greedy_head_i8's screen runs on AMX tiles");
#else
  m.def("amx_screen", [] { return false; }, "whether greedy_head_i8's screen runs on AMX tiles");
#endif
  m.attr("PANEL_WIDTH") = kPanel;
#ifdef TANDEM_GREEDY_HEAD
  m.attr("INT8_ROW_LEVELS") = kQuantMax;  // |q_x| of greedy_head_i8's quantized rows
  m.attr("HALF_SCREEN_MAX_ROWS") = kHalfScreenMaxRows;  // greedy_head_f16 pays off up to
#endif
}
