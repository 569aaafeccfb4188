// Attention of one-token queries (decode) over their paged context.

#include "attention.h"

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
// products are summed in 16 lanes and the lanes as a tree; left to the
// compiler, the sum became a chain of 16 dependent scalar adds per dot.
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
// stream at every block edge.
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
  // Waking a second thread costs more than a short context's whole attention:
  // under 1024 (token, kv head) pairs in all (about 30 us on one thread) the
  // caller's thread does it alone. Above, the threads share it: on two Sapphire
  // Rapids cores 16 sequences of 300 tokens took 0.45 ms a layer, against 1.4
  // ms on one thread (docs/benchmarks.md). A task is one sequence, all its kv
  // heads (their keys are contiguous); with fewer sequences than threads, one
  // (sequence, kv head).
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) work += lp[b];
  const int64_t split = batch < at::get_num_threads() ? kv_heads : 1;
  const int64_t tasks = batch * split, per = kv_heads / split;
  const int64_t grain = work * kv_heads < 1024 ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / split, h0 = task % split * per;
      run(a, b, h0, h0 + per, scores, acc);
    }
  });
  return out;
}
