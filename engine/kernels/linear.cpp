// Linear layers: x [M, K] times a weight packed in panels of 32 columns,
// [ceil(N / 32), K, 32] (engine.kernels.PackedWeight.pack). One panel's
// K x 32 floats are contiguous, so a panel streams linearly from memory and
// stays in L1/L2 while every row block of x passes over it; MKL instead
// repacks the [K, N] weight on each call, which costs as much as the
// arithmetic when M is a decode batch (docs/cpu-kernels.md has the figures).
// Each output is summed over k in order, with fused multiply-adds.

#include "linear_tiles.h"

namespace {

// Rows of x per block: every panel passes over one block before the next, so
// that the block stays in L2 (kRowBlockBytes of it) instead of streaming all of
// x from L3 once per panel. A multiple of kTileRows, so only the last block
// has rows left over. The sums are the same (bit for bit); it pays off at
// prefill-sized batches (M in the thousands).
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
// going through memory twice (faster at prefill-sized batches, the same
// at decode batches).
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
