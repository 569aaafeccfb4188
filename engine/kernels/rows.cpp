// Kernels that take a batch row by row: RMSNorm (alone and fused with the
// residual add), SiLU-and-multiply, the rotary embedding fused with the
// KV-cache store, and the sampler's greedy pick (argmax_rows).

#include "common.h"

namespace {

inline void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
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
