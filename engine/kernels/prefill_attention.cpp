// Prefill attention: the query rows of one prompt (or prompt chunk) over its
// paged context, causal: the row at position context + i sees keys
// [0, context + i]. Each kv head's keys are first laid out in 16-key tiles,
// transposed, so a query row's 16 scores are d multiply-adds of a broadcast
// query value and a tile row, eight rows at a time. A task is one kv head
// and up to kPrefillPositions positions (all their query heads); two passes,
// as the decode kernel: scores and softmax, then the values, up to four
// rows at a time. The multiply-adds are fused (FMA): the result is within
// float32 rounding of the PyTorch path, not equal to it bit for bit. It
// beats SDPA up to a few thousand keys, after which each row's scores over
// the whole context leave the cache: engine/attention.py takes it up to
// FUSED_PREFILL_MAX_KEYS (docs/cpu-kernels.md has the figures).

#include "attention.h"

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
