// Stats pass of a round: one read of the M client rows gives
//   mean[j]     = init[j] + sum_i w_i * (x_i[j] - base[j])   (init, base optional; base: full client models)
//   sq_norms[i] = ||x_i - base||^2
//   nonfinite[i] = any element of row i is NaN or Inf
//   mean_sq     = ||mean||^2
// Per-element math in the compute type (float32, float64 for float64 data); each block's
// partial sums are finished in float64 in block order, so results are bit-identical for
// any thread count.
#include "kernels.h"

#include <vector>

#include "convert.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr int64_t kStatsBlock = 4096;  // 16 KiB of float32 accumulators: stays in L1 while M rows stream by

template <typename T, bool HasBase>
void round_stats_impl(const StatsArgs& a) {
  using C = compute_t<T>;
  const int64_t M = a.num_clients;
  const std::vector<Block> blocks = make_blocks(a.num_segments, a.seg_len, kStatsBlock);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  std::vector<double> part_sq(nb * M), part_mean_sq(nb);
  std::vector<uint8_t> part_bad(nb * M);

#pragma omp parallel
  {
    std::vector<C> acc(kStatsBlock);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const Block blk = blocks[b];
      const int64_t n = blk.len;
      const int64_t col0 = a.seg_off[blk.seg] + blk.start;
      if (a.mean_init) std::copy_n(static_cast<const C*>(a.mean_init) + col0, n, acc.begin());
      else std::fill(acc.begin(), acc.begin() + n, C(0));
      const T* base = HasBase ? as_ptr<const T>(a.base_ptrs[blk.seg]) + blk.start : nullptr;
      for (int64_t i = 0; i < M; ++i) {
        const T* x = as_ptr<const T>(a.row_ptrs[blk.seg * M + i]) + blk.start;
        const C w = static_cast<C>(a.weights[i]);
        C sq = 0, bad = 0;  // bad stays 0 unless some v - v is NaN (v NaN or Inf)
        C* accp = acc.data();
#pragma omp simd reduction(+ : sq, bad)
        for (int64_t j = 0; j < n; ++j) {
          C v = load<C>(x + j);
          if constexpr (HasBase) v -= load<C>(base + j);
          accp[j] += w * v;
          sq += v * v;
          bad += v - v;
        }
        part_sq[b * M + i] = static_cast<double>(sq);
        part_bad[b * M + i] = !(bad == C(0));
      }
      C* mean = static_cast<C*>(a.mean_out) + col0;
      C msq = 0;
      const C* accp = acc.data();
#pragma omp simd reduction(+ : msq)
      for (int64_t j = 0; j < n; ++j) {
        mean[j] = accp[j];
        msq += accp[j] * accp[j];
      }
      part_mean_sq[b] = static_cast<double>(msq);
    }
  }

  double mean_sq = 0;
  for (int64_t i = 0; i < M; ++i) {
    a.sq_norms_out[i] = 0;
    a.nonfinite_out[i] = 0;
  }
  for (int64_t b = 0; b < nb; ++b) {
    mean_sq += part_mean_sq[b];
    for (int64_t i = 0; i < M; ++i) {
      a.sq_norms_out[i] += part_sq[b * M + i];
      a.nonfinite_out[i] |= part_bad[b * M + i];
    }
  }
  *a.mean_sq_out = mean_sq;
}

}  // namespace

void round_stats(const StatsArgs& a) {
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (a.base_ptrs) round_stats_impl<T, true>(a);
    else round_stats_impl<T, false>(a);
  });
}

}  // namespace fastagg
