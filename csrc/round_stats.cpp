// Stats pass of a round: one read of the M client rows gives
//   mean[j]     = init[j] + sum_i w_i * (x_i[j] - base[j])   (init, base optional; base: full client models)
//   sq_norms[i] = ||x_i - base||^2
//   nonfinite[i] = any element of row i is NaN or Inf
//   mean_sq     = ||mean + aux_coef * aux||^2       (aux optional; without it ||mean||^2)
// Rows are converted on load to the compute type C (the mean's: float32, or float64 for float64 params). Squares
// are summed in C within a block (at most kStatsBlock terms per row) and the blocks' sums in float64, in block
// order, so results are bit-identical for any thread count. A block whose C sum overflows while its elements are
// finite (float32 values near 1e18) is summed again in float64: the float64 path costs ~20% of the pass when it
// runs on every element (measured, bench/RESULTS.md), the check costs nothing. Its mirror image: a float32 block sum
// below 2^-80 may have lost squares to underflow (values below ~1e-19 square to subnormals, below ~1e-23 to zero),
// so such a block (tiny values, or zeros) is summed again in float64 too.
// With noise (differential privacy), each block of the mean gets its Gaussian noise (noise.h) right after its last
// fold wrote it, while it is in cache, and ||mean||^2 is that of the noised mean.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "noise.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr double kTinySum = 0x1p-80;  // a float32 block sum this small is redone in float64 (see above): the
                                     // squares lost below FLT_MIN (8192 x 1.2e-38 at most) are then < 1e-9 of it
constexpr int64_t kStatsBlock = 8192;  // 32 KiB of float32 accumulators per thread; 8192-float runs per row
                                       // keep 16 row streams prefetchable (4096 measured ~5% slower, M=16)

// Folds rows i..i+R-1 of one block into acc and returns their squared norms in sq[0..R-1]. Four rows per
// sweep load and store the accumulator once per four rows: per row-element that leaves one load and two
// multiply-adds (measured: 38 -> see bench/RESULTS.md, 2-core AMD EPYC, portable SSE2 build).
// The first fold of a block starts from `start` (the mean's initial value, or nullptr: zero) instead of acc, so
// the initial value is read in the same sweep as the rows, not in a pass of its own (Accumulator.add: M = 1).
// The last fold of a block writes the mean itself (dst = mean), so no separate pass copies acc out; with
// MeanSq it also sums the mean's squares (float64) as it writes them, instead of a second pass over the block
// (measured 1.15-1.28x faster for M = 1, the accumulator's add, on 1 and 2 threads).
template <typename T, typename C, bool HasBase, int R, bool First, bool MeanSq>
inline void fold_rows(const T* const* x, const C* w, const T* base, const C* acc, C* dst, const C* start, int64_t n,
                      C* sq, double* mean_sq) {
  static_assert(R == 1 || R == 4, "fold_rows handles 1 or 4 rows");
  double m = 0;
  if constexpr (R == 4) {
    const T *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    const C w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    C s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, m)
    for (int64_t j = 0; j < n; ++j) {
      const C b = HasBase ? load<C>(base + j) : C(0);
      const C v0 = load<C>(x0 + j) - b, v1 = load<C>(x1 + j) - b;
      const C v2 = load<C>(x2 + j) - b, v3 = load<C>(x3 + j) - b;
      const C a0 = First ? (start ? start[j] : C(0)) : acc[j];
      const C out = a0 + ((w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3));
      dst[j] = out;
      if constexpr (MeanSq) m += double(out) * double(out);
      s0 += v0 * v0;
      s1 += v1 * v1;
      s2 += v2 * v2;
      s3 += v3 * v3;
    }
    sq[0] = s0, sq[1] = s1, sq[2] = s2, sq[3] = s3;
  } else {
    // One row (an Accumulator's add, a step's pass over its sum): the float row sum and the float64 ||mean||^2 in
    // one simd loop did not vectorize (GCC: mixed-width reductions), which left this pass scalar (a step's pass over
    // a 10^7-float sum: 9.6-10.1 ms, now 4.2-6.0 on 2 cores); so the mean's squares are summed in a second loop over
    // the block just written (in L1).
    const T* x0 = x[0];
    const C w0 = w[0];
    const C* a = First ? start : acc;  // null: the mean starts at zero
    C s0 = 0;
    if (a != nullptr) {
#pragma omp simd reduction(+ : s0)
      for (int64_t j = 0; j < n; ++j) {
        const C v0 = load<C>(x0 + j) - (HasBase ? load<C>(base + j) : C(0));
        dst[j] = a[j] + w0 * v0;
        s0 += v0 * v0;
      }
    } else {
#pragma omp simd reduction(+ : s0)
      for (int64_t j = 0; j < n; ++j) {
        const C v0 = load<C>(x0 + j) - (HasBase ? load<C>(base + j) : C(0));
        dst[j] = C(0) + w0 * v0;
        s0 += v0 * v0;
      }
    }
    sq[0] = s0;
    if constexpr (MeanSq) {
#pragma omp simd reduction(+ : m)
      for (int64_t j = 0; j < n; ++j) m += double(dst[j]) * double(dst[j]);
    }
  }
  if constexpr (MeanSq) *mean_sq = m;
}

// One fold of R rows with First / last-with-||mean||^2 chosen at run time.
template <typename T, typename C, bool HasBase, int R>
inline void fold(bool first, bool mean_sq_here, const T* const* x, const C* w, const T* base, const C* acc, C* dst,
                 const C* start, int64_t n, C* sq, double* mean_sq) {
  if (first) {
    if (mean_sq_here) fold_rows<T, C, HasBase, R, true, true>(x, w, base, acc, dst, start, n, sq, mean_sq);
    else fold_rows<T, C, HasBase, R, true, false>(x, w, base, acc, dst, start, n, sq, mean_sq);
  } else {
    if (mean_sq_here) fold_rows<T, C, HasBase, R, false, true>(x, w, base, acc, dst, start, n, sq, mean_sq);
    else fold_rows<T, C, HasBase, R, false, false>(x, w, base, acc, dst, start, n, sq, mean_sq);
  }
}

// True when some element of x - base is NaN or Inf. Only rows whose squared norm came out non-finite are
// rescanned (a finite float64 row can still overflow float64 squares): the hot loop carries no extra flag work.
template <typename T, typename C, bool HasBase>
bool has_nonfinite(const T* x, const T* base, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const C v = load<C>(x + j) - (HasBase ? load<C>(base + j) : C(0));
    if (!(v - v == C(0))) return true;
  }
  return false;
}

// sum_j (x_j - base_j)^2 in float64, for a block whose sum in C overflowed although its elements are finite.
template <typename T, typename C, bool HasBase>
double sq_norm_f64(const T* x, const T* base, int64_t n) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    const double v = double(load<C>(x + j) - (HasBase ? load<C>(base + j) : C(0)));
    s += v * v;
  }
  return s;
}

template <typename T, typename C, bool HasBase>
void round_stats_impl(const StatsArgs& a) {
  const int64_t M = a.num_clients;
  const std::vector<Block> blocks = make_blocks(a.num_segments, a.seg_len, kStatsBlock);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  std::vector<double> part_sq(nb * M), part_mean_sq(nb);
  std::vector<uint8_t> part_bad(nb * M);

  int64_t numel = 0;
  for (int64_t s = 0; s < a.num_segments; ++s) numel += a.seg_len[s];
  const int64_t bytes = numel * (M * static_cast<int64_t>(sizeof(T)) + (HasBase ? sizeof(T) : 0) + 2 * sizeof(C));
  const bool noisy = a.noise_sigma > 0;
#pragma omp parallel num_threads(threads_for(bytes))
  {
    std::vector<C> acc_buf(kStatsBlock);
    std::vector<float> noise_buf(noisy ? kStatsBlock : 0);
    std::vector<C> w(M);
    std::vector<const T*> x(M);
    for (int64_t i = 0; i < M; ++i) w[i] = static_cast<C>(a.weights[i]);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const Block blk = blocks[b];
      const int64_t n = blk.len;
      const int64_t col0 = a.seg_off[blk.seg] + blk.start;
      C* acc = acc_buf.data();
      C* mean = a.mean_out ? static_cast<C*>(a.mean_out) + col0 : acc;  // no mean_out: the block's mean in acc
      const C* start = a.mean_init ? static_cast<const C*>(a.mean_init) + col0 : nullptr;
      if (M == 0) {
        if (start) std::copy_n(start, n, mean);  // (the binding refuses a mean_out that overlaps mean_init)
        else std::fill(mean, mean + n, C(0));
      }
      const T* base = HasBase ? as_ptr<const T>(a.base_ptrs[blk.seg]) + blk.start : nullptr;
      for (int64_t i = 0; i < M; ++i) x[i] = as_ptr<const T>(a.row_ptrs[blk.seg * M + i]) + blk.start;
      C sq[4];
      double msq = 0;  // ||mean||^2 over the block, summed by the last fold as it writes the mean (no aux)
      int64_t i = 0;
      const int64_t M4 = M / 4 * 4;
      for (; i < M4; i += 4) {
        const bool last = i + 4 == M;
        fold<T, C, HasBase, 4>(i == 0, last && !a.aux && !noisy, x.data() + i, w.data() + i, base, acc, last ? mean : acc,
                               start, n, sq, &msq);
        for (int r = 0; r < 4; ++r) part_sq[b * M + i + r] = sq[r];
      }
      for (; i < M; ++i) {
        const bool last = i + 1 == M;
        fold<T, C, HasBase, 1>(i == 0, last && !a.aux && !noisy, x.data() + i, w.data() + i, base, acc, last ? mean : acc,
                               start, n, sq, &msq);
        part_sq[b * M + i] = sq[0];
      }
      for (i = 0; i < M; ++i) {
        const double s = part_sq[b * M + i];
        if (std::isfinite(s)) {
          if (std::is_same_v<C, float> && s < kTinySum) part_sq[b * M + i] = sq_norm_f64<T, C, HasBase>(x[i], base, n);
          continue;
        }
        part_bad[b * M + i] = has_nonfinite<T, C, HasBase>(x[i], base, n);
        if (!part_bad[b * M + i]) part_sq[b * M + i] = sq_norm_f64<T, C, HasBase>(x[i], base, n);
      }
      if (noisy) {
        float* z = noise_buf.data();
        gaussian_fill(a.noise_seed, a.noise_round, col0, n, z);
        const C sigma = static_cast<C>(a.noise_sigma);
        if (a.aux) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) mean[j] += sigma * static_cast<C>(z[j]);
        } else {
#pragma omp simd reduction(+ : msq)
          for (int64_t j = 0; j < n; ++j) {
            mean[j] += sigma * static_cast<C>(z[j]);
            msq += double(mean[j]) * double(mean[j]);
          }
        }
      }
      if (a.aux) {  // ||mean + aux_coef * aux||^2 over the block just written (in cache): FedExP-M's momentum
        const C* aux = static_cast<const C*>(a.aux) + col0;
        const C c = static_cast<C>(a.aux_coef);
#pragma omp simd reduction(+ : msq)
        for (int64_t j = 0; j < n; ++j) {
          const double u = double(mean[j] + c * aux[j]);
          msq += u * u;
        }
      } else if (M == 0 && !noisy) {
#pragma omp simd reduction(+ : msq)
        for (int64_t j = 0; j < n; ++j) msq += double(mean[j]) * double(mean[j]);
      }
      part_mean_sq[b] = msq;
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
    auto go = [&](auto ctag) {
      using C = decltype(ctag);
      if (a.base_ptrs) round_stats_impl<T, C, true>(a);
      else round_stats_impl<T, C, false>(a);
    };
    if (a.compute_dtype == kFloat64) go(double{});
    else go(float{});
  });
}

}  // namespace fastagg
