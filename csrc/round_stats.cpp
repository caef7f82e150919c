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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FASTAGG_STREAM_FOLD 1
#endif

#include "convert.h"
#include "noise.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr double kTinySum = 0x1p-80;  // a float32 block sum this small is redone in float64 (see above): the
                                     // squares lost below FLT_MIN (8192 x 1.2e-38 at most) are then < 1e-9 of it
constexpr int64_t kStatsBlock = 8192;  // the reduction unit: squares summed in C over at most this many columns
// The traversal unit: a run of up to kRunBlocks consecutive blocks of one segment, which each group of rows sweeps
// whole (128 KiB per float32 row stream, 4 x 32 KiB) before the next group starts; every block's sums are formed
// exactly as before (same folds, same order), only the order in which blocks are visited changed. Longer runs per
// row stream keep the hardware prefetcher going across the 4 KiB page boundaries (a stream restarts at each new
// run): 16 x 1e7 float32 with a base, 1 thread: 8 rows a sweep, runs of 1 / 2 / 4 / 8 blocks: 36.4 / 36.3 / 34.3 /
// 34.5 ms (bench_stats_pass.py's C++ twin, interleaved). The run's accumulator, 128 KiB a thread, sits in L2.
constexpr int64_t kRunBlocks = 4;
// Blocks of at least kWideBlock columns fold 8 rows per sweep, shorter ones 4 (the 8-row loop spills four of its
// square sums to the stack under AVX2: fine when memory is the limit, 13-29% slower on blocks of 8-64 columns).
// Either way the mean and the sums are the same bits: rows enter the mean 4 at a time in the same order.
constexpr int64_t kWideBlock = 1024;

// Where a fold's running mean comes from: the accumulator (a later fold of the block), the mean's initial value
// (the first fold, mean_init given) or zero (the first fold without one). Zero is its own loop: `start ? start[j]
// : 0` inside the loop left GCC's vector loop unused for it, so the first fold of every block ran scalar (a
// quarter of the work of a 16-client FedAvg round without mean_init: 16 x 1e7 with a base 47.0 -> 42.2 ms).
enum From : int { kFromAcc = 0, kFromZero = 1 };

// Folds rows x[0..R-1] of one block into the running mean a (kFromAcc), writes it to dst and returns the rows'
// squared norms over the block in sq[0..R-1]. Rows enter the mean four at a time,
//   dst = a + ((w0 v0 + w1 v1) + (w2 v2 + w3 v3))       (then the next four onto that, for R = 8),
// so a block's mean is the same bits whichever R folded it. Sweeping R rows at once loads and stores the
// accumulator once per R rows: per row-element that leaves one load and two multiply-adds.
// The first fold of a block reads the mean's initial value (start, or zero) instead of acc, so the initial value is
// read in the same sweep as the rows, not in a pass of its own (Accumulator.add: M = 1). The last fold of a block
// writes the mean itself (dst = mean), so no separate pass copies acc out; with MeanSq it also sums the mean's
// squares (float64) as it writes them (R = 4; measured 1.15-1.28x faster for M = 1, the accumulator's add, on 1
// and 2 threads), or right after them over the block just written, in L1 (R = 1 and 8: GCC leaves a loop with a
// float and a float64 reduction scalar, or at half width).
template <typename T, typename C, bool HasBase, int R, int Src, bool MeanSq>
inline void fold_rows(const T* const* x, const C* w, const T* base, const C* a, C* dst, int64_t n, C* sq,
                      double* mean_sq) {
  static_assert(R == 1 || R == 4 || R == 8, "fold_rows handles 1, 4 or 8 rows");
  double m = 0;
  if constexpr (R == 8) {
    const T *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5], *x6 = x[6], *x7 = x[7];
    const C w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3], w4 = w[4], w5 = w[5], w6 = w[6], w7 = w[7];
    C s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
    for (int64_t j = 0; j < n; ++j) {
      const C b = HasBase ? load<C>(base + j) : C(0);
      const C v0 = load<C>(x0 + j) - b, v1 = load<C>(x1 + j) - b;
      const C v2 = load<C>(x2 + j) - b, v3 = load<C>(x3 + j) - b;
      const C v4 = load<C>(x4 + j) - b, v5 = load<C>(x5 + j) - b;
      const C v6 = load<C>(x6 + j) - b, v7 = load<C>(x7 + j) - b;
      const C a0 = Src == kFromZero ? C(0) : a[j];
      const C half = a0 + ((w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3));
      dst[j] = half + ((w4 * v4 + w5 * v5) + (w6 * v6 + w7 * v7));
      s0 += v0 * v0;
      s1 += v1 * v1;
      s2 += v2 * v2;
      s3 += v3 * v3;
      s4 += v4 * v4;
      s5 += v5 * v5;
      s6 += v6 * v6;
      s7 += v7 * v7;
    }
    sq[0] = s0, sq[1] = s1, sq[2] = s2, sq[3] = s3, sq[4] = s4, sq[5] = s5, sq[6] = s6, sq[7] = s7;
  } else if constexpr (R == 4) {
    const T *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    const C w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    C s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, m)
    for (int64_t j = 0; j < n; ++j) {
      const C b = HasBase ? load<C>(base + j) : C(0);
      const C v0 = load<C>(x0 + j) - b, v1 = load<C>(x1 + j) - b;
      const C v2 = load<C>(x2 + j) - b, v3 = load<C>(x3 + j) - b;
      const C a0 = Src == kFromZero ? C(0) : a[j];
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
    // a 10^7-float sum: 9.6-10.1 ms, now 4.2-6.0 on 2 cores); so the mean's squares are summed in a second loop.
    const T* x0 = x[0];
    const C w0 = w[0];
    C s0 = 0;
#pragma omp simd reduction(+ : s0)
    for (int64_t j = 0; j < n; ++j) {
      const C v0 = load<C>(x0 + j) - (HasBase ? load<C>(base + j) : C(0));
      dst[j] = (Src == kFromZero ? C(0) : a[j]) + w0 * v0;
      s0 += v0 * v0;
    }
    sq[0] = s0;
  }
  if constexpr (MeanSq && R != 4) {
#pragma omp simd reduction(+ : m)
    for (int64_t j = 0; j < n; ++j) m += double(dst[j]) * double(dst[j]);
  }
  if constexpr (MeanSq) *mean_sq = m;
}

// A pass of at least this many bytes (rows, base, mean_init, the mean) that ends in a one-row fold of float32 rows
// (Accumulator.add: M = 1; a held batch of M = 4k + 1) writes the mean with streaming (non-temporal) stores: by the
// end of such a pass the mean's first lines are long evicted, so a plain store's fill of each line from memory (the
// write-allocate read, a quarter of an add's traffic) only adds traffic. (Forming the run's mean in the L2
// accumulator and streaming it out afterwards was slower than plain stores: the copy's stores then do not overlap
// the reads; the stores have to stream from the fold loop itself.)
constexpr int64_t kStreamBytes = int64_t(64) << 20;

#ifdef FASTAGG_STREAM_FOLD
// fold_rows<float, float, HasBase, 1, kFromAcc, MeanSq> with the mean written by streaming stores; dst 32-byte
// aligned. The same bits, lane for lane what GCC makes of fold_rows' omp simd loops (-O3 -mavx2 -mfma): the mean
// w0 * v + a as one fma; squares summed in 8 lane sums (fma), the n % 8 tail elements into lane 0, then the lanes
// 0..7 added in order onto 0; ||mean||^2 likewise in float64 lanes (0-3 from the low half of each 8, 4-7 from the
// high half), here from the registers (fold_rows re-reads dst, which a streamed dst is not in cache for).
// tests/test_stats_pass_stream.py checks the bits against the plain path.
template <bool HasBase, bool MeanSq>
void fold1_stream(const float* x0, float w0, const float* base, const float* a, float* dst, int64_t n, float* sq,
                  double* mean_sq) {
  const __m256 w = _mm256_set1_ps(w0);
  __m256 s = _mm256_setzero_ps();
  __m256d m_lo = _mm256_setzero_pd(), m_hi = _mm256_setzero_pd();
  const int64_t n8 = n & ~int64_t(7);
  for (int64_t j = 0; j < n8; j += 8) {
    __m256 v = _mm256_loadu_ps(x0 + j);
    if constexpr (HasBase) v = _mm256_sub_ps(v, _mm256_loadu_ps(base + j));
    const __m256 out = _mm256_fmadd_ps(w, v, _mm256_loadu_ps(a + j));
    _mm256_stream_ps(dst + j, out);
    s = _mm256_fmadd_ps(v, v, s);
    if constexpr (MeanSq) {
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(out));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(out, 1));
      m_lo = _mm256_fmadd_pd(lo, lo, m_lo);
      m_hi = _mm256_fmadd_pd(hi, hi, m_hi);
    }
  }
  alignas(32) float sl[8];
  alignas(32) double ml[8];
  _mm256_store_ps(sl, s);
  _mm256_store_pd(ml, m_lo);
  _mm256_store_pd(ml + 4, m_hi);
  for (int64_t j = n8; j < n; ++j) {
    const float v = HasBase ? x0[j] - base[j] : x0[j];
    const float out = std::fma(w0, v, a[j]);
    dst[j] = out;
    sl[0] = std::fma(v, v, sl[0]);
    if constexpr (MeanSq) ml[0] = std::fma(double(out), double(out), ml[0]);
  }
  float s0 = 0;
  double m = 0;
  for (int k = 0; k < 8; ++k) s0 += sl[k];
  *sq = s0;
  if constexpr (MeanSq) {
    for (int k = 0; k < 8; ++k) m += ml[k];
    *mean_sq = m;
  }
}
#endif

// One fold of R rows with the mean's source and last-with-||mean||^2 chosen at run time; `stream`: the mean (dst,
// on the last fold) may be written with streaming stores.
template <typename T, typename C, bool HasBase, int R>
inline void fold(bool first, bool mean_sq_here, const T* const* x, const C* w, const T* base, const C* acc, C* dst,
                 const C* start, int64_t n, C* sq, double* mean_sq, bool stream) {
#ifdef FASTAGG_STREAM_FOLD
  if constexpr (R == 1 && std::is_same_v<T, float> && std::is_same_v<C, float>) {
    if (stream && !(first && start == nullptr) && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
      const C* a = first ? start : acc;
      if (mean_sq_here) fold1_stream<HasBase, true>(x[0], w[0], base, a, dst, n, sq, mean_sq);
      else fold1_stream<HasBase, false>(x[0], w[0], base, a, dst, n, sq, mean_sq);
      return;
    }
  }
#endif
  (void)stream;
  if (first && start == nullptr) {
    if (mean_sq_here) fold_rows<T, C, HasBase, R, kFromZero, true>(x, w, base, nullptr, dst, n, sq, mean_sq);
    else fold_rows<T, C, HasBase, R, kFromZero, false>(x, w, base, nullptr, dst, n, sq, mean_sq);
  } else {
    const C* a = first ? start : acc;
    if (mean_sq_here) fold_rows<T, C, HasBase, R, kFromAcc, true>(x, w, base, a, dst, n, sq, mean_sq);
    else fold_rows<T, C, HasBase, R, kFromAcc, false>(x, w, base, a, dst, n, sq, mean_sq);
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

// Rows i..i+R-1 folded over every block of a run [b0, b1) (see kRunBlocks): x holds each row's first element of
// the run, base / start / mean the run's first columns, acc the run's accumulator.
template <typename T, typename C, bool HasBase, int R>
inline void fold_run(const std::vector<Block>& blocks, int64_t b0, int64_t b1, int64_t i, int64_t M, bool mean_sq,
                     const T* const* x, const C* w, const T* base, const C* start, C* acc, C* mean,
                     double* part_sq, double* run_msq, bool stream) {
  const int64_t start0 = blocks[b0].start;
  const bool first = i == 0, last = i + R == M;
  const T* xb[R];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t off = blocks[b].start - start0, n = blocks[b].len;
    for (int q = 0; q < R; ++q) xb[q] = x[i + q] + off;
    C sq[R];
    fold<T, C, HasBase, R>(first, last && mean_sq, xb, w + i, HasBase ? base + off : nullptr, acc + off,
                           last ? mean + off : acc + off, start ? start + off : nullptr, n, sq, &run_msq[b - b0],
                           stream && last && mean != acc);
    for (int q = 0; q < R; ++q) part_sq[b * M + i + q] = sq[q];
  }
}

template <typename T, typename C, bool HasBase>
void round_stats_impl(const StatsArgs& a) {
  const int64_t M = a.num_clients;
  const std::vector<Block> blocks = make_blocks(a.num_segments, a.seg_len, kStatsBlock);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  std::vector<int64_t> runs;  // first block of each run, then nb
  for (int64_t b = 0; b < nb; ++b)
    if (b == 0 || blocks[b].seg != blocks[b - 1].seg || b - runs.back() == kRunBlocks) runs.push_back(b);
  const int64_t nr = static_cast<int64_t>(runs.size());
  runs.push_back(nb);
  std::vector<double> part_sq(nb * M), part_mean_sq(nb);
  std::vector<uint8_t> part_bad(nb * M);

  int64_t numel = 0;
  for (int64_t s = 0; s < a.num_segments; ++s) numel += a.seg_len[s];
  const int64_t bytes = numel * (M * static_cast<int64_t>(sizeof(T)) + (HasBase ? sizeof(T) : 0) + 2 * sizeof(C));
  const bool noisy = a.noise_sigma > 0;
  // streaming stores for the mean (see kStreamBytes); noise and aux read the mean back right after: not then
  const bool stream = a.mean_out && !noisy && !a.aux && bytes >= kStreamBytes;
#pragma omp parallel num_threads(threads_for(bytes))
  {
    std::vector<C> acc_buf(kRunBlocks * kStatsBlock);
    std::vector<float> noise_buf(noisy ? kStatsBlock : 0);
    std::vector<C> w(M);
    std::vector<const T*> x(M);
    double run_msq[kRunBlocks];
    for (int64_t i = 0; i < M; ++i) w[i] = static_cast<C>(a.weights[i]);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t b0 = runs[r], b1 = runs[r + 1];
      const int64_t seg = blocks[b0].seg, start0 = blocks[b0].start, run_col0 = a.seg_off[seg] + start0;
      C* acc = acc_buf.data();
      C* mean = a.mean_out ? static_cast<C*>(a.mean_out) + run_col0 : acc;  // no mean_out: the run's mean in acc
      const C* start = a.mean_init ? static_cast<const C*>(a.mean_init) + run_col0 : nullptr;
      const T* base = HasBase ? as_ptr<const T>(a.base_ptrs[seg]) + start0 : nullptr;
      for (int64_t i = 0; i < M; ++i) x[i] = as_ptr<const T>(a.row_ptrs[seg * M + i]) + start0;
      for (int64_t k = 0; k < b1 - b0; ++k) run_msq[k] = 0;  // ||mean||^2 of each block, summed by its last fold
      const bool mean_sq_here = !a.aux && !noisy;
      const bool wide = blocks[b0].len >= kWideBlock;
      int64_t i = 0;
      for (; wide && i + 8 <= M; i += 8)
        fold_run<T, C, HasBase, 8>(blocks, b0, b1, i, M, mean_sq_here, x.data(), w.data(), base, start, acc, mean,
                                   part_sq.data(), run_msq, stream);
      for (; i + 4 <= M; i += 4)
        fold_run<T, C, HasBase, 4>(blocks, b0, b1, i, M, mean_sq_here, x.data(), w.data(), base, start, acc, mean,
                                   part_sq.data(), run_msq, stream);
      for (; i < M; ++i)
        fold_run<T, C, HasBase, 1>(blocks, b0, b1, i, M, mean_sq_here, x.data(), w.data(), base, start, acc, mean,
                                   part_sq.data(), run_msq, stream);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t off = blocks[b].start - start0, n = blocks[b].len, col0 = run_col0 + off;
        C* bmean = mean + off;
        const T* bbase = HasBase ? base + off : nullptr;
        double msq = run_msq[b - b0];
        if (M == 0) {
          if (start) std::copy_n(start + off, n, bmean);  // (the binding refuses a mean_out that overlaps mean_init)
          else std::fill(bmean, bmean + n, C(0));
        }
        for (i = 0; i < M; ++i) {
          const double s = part_sq[b * M + i];
          if (std::isfinite(s)) {
            if (std::is_same_v<C, float> && s < kTinySum)
              part_sq[b * M + i] = sq_norm_f64<T, C, HasBase>(x[i] + off, bbase, n);
            continue;
          }
          part_bad[b * M + i] = has_nonfinite<T, C, HasBase>(x[i] + off, bbase, n);
          if (!part_bad[b * M + i]) part_sq[b * M + i] = sq_norm_f64<T, C, HasBase>(x[i] + off, bbase, n);
        }
        if (noisy) {
          float* z = noise_buf.data();
          gaussian_fill(a.noise_seed, a.noise_round, col0, n, z);
          const C sigma = static_cast<C>(a.noise_sigma);
          if (a.aux) {
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) bmean[j] += sigma * static_cast<C>(z[j]);
          } else {
#pragma omp simd reduction(+ : msq)
            for (int64_t j = 0; j < n; ++j) {
              bmean[j] += sigma * static_cast<C>(z[j]);
              msq += double(bmean[j]) * double(bmean[j]);
            }
          }
        }
        if (a.aux) {  // ||mean + aux_coef * aux||^2 over the block just written (in cache): FedExP-M's momentum
          const C* aux = static_cast<const C*>(a.aux) + col0;
          const C c = static_cast<C>(a.aux_coef);
#pragma omp simd reduction(+ : msq)
          for (int64_t j = 0; j < n; ++j) {
            const double u = double(bmean[j] + c * aux[j]);
            msq += u * u;
          }
        } else if (M == 0 && !noisy) {
#pragma omp simd reduction(+ : msq)
          for (int64_t j = 0; j < n; ++j) msq += double(bmean[j]) * double(bmean[j]);
        }
        part_mean_sq[b] = msq;
      }
    }
#ifdef FASTAGG_STREAM_FOLD
    if (stream) _mm_sfence();  // this thread's streamed lines visible before the team's closing barrier
#endif
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
