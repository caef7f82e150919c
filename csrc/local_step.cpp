// Batched local steps: M client rows updated by one call. Per row:
//   dir  = g + prox * (x - anchor) + (c - c_i)                    (terms optional)
//   pass 1: s = ||dir||^2 (float32 block sums, float64 across blocks, fixed order)
//   scale = min(1, clip_norm / sqrt(s));  s2 = s * scale^2         (the direction actually stepped along)
//   step = lr_i                                                    (rule FIXED)
//        = min((f_i - l*_i) / (c_i * s2), cap_i)                   (rule SPS; FedDecSPS passes its c_t and cap)
//   a row whose s, loss or step is not finite, whose loss is <= l*, or whose s2 <= tiny takes no step: nothing
//   of it (params, buffers) is written and step_out[i] = 0.
//   pass 2: d = scale * dir + weight_decay * x, then
//     NONE:     x -= step * d
//     HEAVY:    b = mu b + d;  x -= step * b                          (torch SGD momentum, dampening 0)
//     NESTEROV: b = mu b + d;  x -= step * (d + mu b)                 (torch SGD nesterov)
//     MASS:     w = x - step * d;  x = w + mu (w - b) + eta2 * d;  b = w   (FedMaSS; eta2 = 0: paper 004's Nesterov;
//               b is taken as x on a row's first step, w_0 = u_0)
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "convert.h"
#include "kernels.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr int64_t kLocalBlock = 4096;
constexpr int kLanes = 16;
// Sweep 1 reads kNormStreams blocks at once, sweep 2 updates kUpdateStreams blocks at once (for_block_groups).
// Measured on the 2-core VM, M = 100 x d = 1e5 fp32 (bench/RESULTS.md), the kernel alone: one stream per sweep
// 1.29-1.38x of X.add_(G), 4 + 2 streams 1.04-1.12x; 8 norm or 4 update streams measured the same as 4 and 2.
constexpr int kNormStreams = 4;
constexpr int kUpdateStreams = 2;
constexpr int64_t kUpdateChunk = 64;  // elements of one stream updated before moving to the next
// Fewer than 4 rows per thread, each of at least this size: all threads sweep each row together (rows_shared).
constexpr int64_t kSharedRowBytes = 1 << 16;

template <typename P, typename C, bool HasAnchor, bool HasControl>
struct Direction {
  const P* x;
  const P* g;
  const P* a;
  const C* c;
  const C* ci;
  C prox;
  inline C operator()(int64_t j) const {
    C v = load<C>(g + j);
    if constexpr (HasAnchor) v += prox * (load<C>(x + j) - load<C>(a + j));
    if constexpr (HasControl) v += c[j] - ci[j];
    return v;
  }
};

template <typename C>
struct Coefs {
  C step, scale, wd, mu, eta2, keep, move;
  Coefs(double st, double sc, const LocalArgs& a)
      : step(static_cast<C>(st)), scale(static_cast<C>(sc)), wd(static_cast<C>(a.weight_decay)),
        mu(static_cast<C>(a.momentum)), eta2(static_cast<C>(a.eta2)), keep(C(1) - step * wd), move(step * scale) {}
};

// One row: its blocks' squared-norm partials (sweep 1) and its update (sweep 2), over any range of its blocks.
template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
struct Row {
  using Dir = Direction<P, C, HasAnchor, HasControl>;
  P* x;
  Dir dir;
  C* buf;
  bool first;
  int64_t numel;

  Row(const LocalArgs& a, int64_t i)
      : x(as_ptr<P>(a.x_ptrs[i])),
        dir{x, as_ptr<const P>(a.g_ptrs[i]), HasAnchor ? as_ptr<const P>(a.anchor_ptrs[i]) : nullptr,
            HasControl ? static_cast<const C*>(a.control) : nullptr,
            HasControl ? as_ptr<const C>(a.ci_ptrs[i]) : nullptr, static_cast<C>(a.prox)},
        buf(Mode != kModeNone ? as_ptr<C>(a.buf_ptrs[i]) : nullptr),
        first(Mode == kModeMass && a.first != nullptr && a.first[i] != 0),
        numel(a.numel) {}

  // Sixteen independent lanes per block (a single accumulator chains every add on its latency); the lanes are
  // summed in order, then the short tail. group_sq gives each of its blocks exactly this sum. Squares are summed
  // in A: C for the pass, float64 again for a block whose C sum overflowed (float32 values near 1e18; a float64
  // pass throughout measured ~25% slower, bench/RESULTS.md). A block holding Inf/NaN stays non-finite either way.
  template <typename A>
  A block_sq_in(int64_t b0, int64_t end) const {
    A lanes[kLanes] = {};
    int64_t j = b0;
    for (; j + kLanes <= end; j += kLanes) {
#pragma omp simd
      for (int k = 0; k < kLanes; ++k) {
        const A v = dir(j + k);
        lanes[k] += v * v;
      }
    }
    A part = 0;
    for (int k = 0; k < kLanes; ++k) part += lanes[k];
    for (; j < end; ++j) {
      const A v = dir(j);
      part += v * v;
    }
    return part;
  }

  // Mirror image of the overflow: a float32 block sum below 2^-80 may have lost squares to underflow (gradients
  // below ~1e-19), so it is summed again in float64 too.
  double checked(C sum, int64_t b0, int64_t end) const {
    const bool tiny = std::is_same_v<C, float> && double(sum) < 0x1p-80;
    return std::isfinite(sum) && !tiny ? double(sum) : block_sq_in<double>(b0, end);
  }

  double block_sq(int64_t b0, int64_t end) const { return checked(block_sq_in<C>(b0, end), b0, end); }

  void group_sq(const int64_t* starts, double* part) const {
    C lanes[kNormStreams][kLanes] = {};
    for (int64_t j = 0; j < kLocalBlock; j += kLanes) {
      for (int s = 0; s < kNormStreams; ++s) {
        const int64_t o = starts[s] + j;
#pragma omp simd
        for (int k = 0; k < kLanes; ++k) {
          const C v = dir(o + k);
          lanes[s][k] += v * v;
        }
      }
    }
    for (int s = 0; s < kNormStreams; ++s) {
      C sum = 0;
      for (int k = 0; k < kLanes; ++k) sum += lanes[s][k];
      part[starts[s] / kLocalBlock] = checked(sum, starts[s], starts[s] + kLocalBlock);
    }
  }

  // part[b] = squared norm of block b, for blocks [b0, b1).
  void sq_blocks(int64_t b0, int64_t b1, double* part) const {
    for_block_groups<kNormStreams>(
        b0, b1, kLocalBlock, numel, [&](const int64_t* starts) { group_sq(starts, part); },
        [&](int64_t start, int64_t stop) { part[start / kLocalBlock] = block_sq(start, stop); });
  }

  // An element whose new x or state would not be finite keeps its old values: nothing non-finite is stored (an
  // element already Inf/NaN stays as it was). Bitwise & and selects keep the loop vectorized.
  inline void update_at(int64_t j, const Coefs<C>& k) {
    const C xj = load<C>(x + j);
    C xn, bj, b_old = xj;
    if constexpr (Mode == kModeNone) {
      xn = k.keep * xj - k.move * dir(j);  // = x - step (scale dir + wd x), two multiplies
      bj = xn;
    } else {
      const C dj = k.scale * dir(j) + k.wd * xj;
      b_old = buf[j];
      if constexpr (Mode == kModeHeavy) {
        bj = k.mu * b_old + dj;
        xn = xj - k.step * bj;
      } else if constexpr (Mode == kModeNesterov) {
        bj = k.mu * b_old + dj;
        xn = xj - k.step * (dj + k.mu * bj);
      } else {
        bj = xj - k.step * dj;  // w
        xn = bj + k.mu * (bj - (first ? xj : b_old)) + k.eta2 * dj;
      }
    }
    const bool good = stays_finite<P>(xn) & finite_c(bj);
    store(x + j, good ? xn : xj);
    if constexpr (Mode != kModeNone) buf[j] = good ? bj : b_old;
  }

  void update_range(int64_t b0, int64_t end, const Coefs<C>& k) {
#pragma omp simd
    for (int64_t j = b0; j < end; ++j) update_at(j, k);
  }

  void update_group(const int64_t* starts, const Coefs<C>& k) {
    for (int64_t j = 0; j < kLocalBlock; j += kUpdateChunk) {
      for (int s = 0; s < kUpdateStreams; ++s) {
        const int64_t o = starts[s] + j;
#pragma omp simd
        for (int64_t e = 0; e < kUpdateChunk; ++e) update_at(o + e, k);
      }
    }
  }

  void update_blocks(int64_t b0, int64_t b1, double step, double scale, const LocalArgs& a) {
    const Coefs<C> k(step, scale, a);
    for_block_groups<kUpdateStreams>(
        b0, b1, kLocalBlock, numel, [&](const int64_t* starts) { update_group(starts, k); },
        [&](int64_t start, int64_t stop) { update_range(start, stop, k); });
  }
};

// The row's clip scale and step from its squared direction norm s; no step unless it is finite and positive in
// the compute type C too (a float64 step of 1e39 would be Inf in float32).
template <typename C>
inline double row_step(const LocalArgs& a, int64_t i, double s, double* scale_out) {
  double scale = 1.0;
  if (a.clip_norm > 0 && s > a.clip_norm * a.clip_norm) scale = a.clip_norm / std::sqrt(s);
  const double s2 = s * scale * scale;
  double step = 0;
  if (std::isfinite(s)) {
    if (a.rule == kRuleFixed) {
      step = a.lr[i];
    } else {
      const double f = a.loss[i], ls = a.l_star[i];
      if (std::isfinite(f) && f > ls && s2 > a.tiny) step = std::min((f - ls) / (a.sps_c[i] * s2), a.cap[i]);
    }
  }
  if (!std::isfinite(step) || !std::isfinite(static_cast<double>(static_cast<C>(step))) || step <= 0) step = 0;
  *scale_out = scale;
  return step;
}


inline double sum_in_order(const double* part, int64_t n) {
  double s = 0;
  for (int64_t b = 0; b < n; ++b) s += part[b];
  return s;
}

inline int thread_count() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// One thread per row (short rows, or enough rows to occupy every thread). Sweep 2 finds most of the row's gradient
// still in the core's caches. (Splitting 400 KB rows across both cores of the 2-core VM, so each core's share of
// the gradient fits its 512 KiB L2 whole, measured the same: 1.08-1.11x of X.add_(G) either way, M = 100.)
// Memory a call touches: x and g read twice and x written, the optional anchor, control rows and momentum buffer.
template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
int64_t call_bytes(const LocalArgs& a) {
  const int64_t per = 3 * sizeof(P) + 2 * sizeof(P) + (HasAnchor ? 2 * sizeof(P) : 0) +
                      (HasControl ? 4 * sizeof(C) : 0) + (Mode != kModeNone ? 2 * sizeof(C) : 0);
  return a.num_rows * a.numel * per;
}

template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
void rows_per_thread(const LocalArgs& a, int threads) {
  const int64_t d = a.numel, nb = (d + kLocalBlock - 1) / kLocalBlock;
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> part(nb);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < a.num_rows; ++i) {
      Row<P, C, HasAnchor, HasControl, Mode> row(a, i);
      row.sq_blocks(0, nb, part.data());
      const double s = sum_in_order(part.data(), nb);
      double scale;
      const double step = row_step<C>(a, i, s, &scale);
      a.step_out[i] = step;
      if (step != 0) row.update_blocks(0, nb, step, scale, a);
    }
  }
}

// All threads on each row (few long rows): each thread takes the same range of the row's blocks in both sweeps, so
// it updates the blocks whose gradient it just read. Block partials are summed in block order: the result does not
// depend on the thread count. Partials alternate between two buffers, so a thread that runs ahead into the next
// row cannot overwrite what a slower one is still summing.
template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
void rows_shared(const LocalArgs& a, int threads) {
  const int64_t d = a.numel, nb = (d + kLocalBlock - 1) / kLocalBlock;
  std::vector<double> parts(2 * nb);
#pragma omp parallel num_threads(threads)
  {
    const int64_t threads = thread_count(), t = thread_index();
    const int64_t b0 = nb * t / threads, b1 = nb * (t + 1) / threads;
    for (int64_t i = 0; i < a.num_rows; ++i) {
      Row<P, C, HasAnchor, HasControl, Mode> row(a, i);
      double* part = parts.data() + (i % 2) * nb;
      row.sq_blocks(b0, b1, part);
#pragma omp barrier
      const double s = sum_in_order(part, nb);
      double scale;
      const double step = row_step<C>(a, i, s, &scale);
      if (t == 0) a.step_out[i] = step;
      if (step != 0) row.update_blocks(b0, b1, step, scale, a);
    }
  }
}

template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
void local_rows(const LocalArgs& a) {
  const int threads = threads_for(call_bytes<P, C, HasAnchor, HasControl, Mode>(a));
  if (threads > 1 && a.num_rows < 4 * threads && a.numel * static_cast<int64_t>(sizeof(P)) >= kSharedRowBytes)
    rows_shared<P, C, HasAnchor, HasControl, Mode>(a, threads);
  else
    rows_per_thread<P, C, HasAnchor, HasControl, Mode>(a, threads);
}

template <typename P, typename C, bool HasAnchor, bool HasControl>
void with_mode(const LocalArgs& a) {
  switch (a.mode) {
    case kModeNone: local_rows<P, C, HasAnchor, HasControl, kModeNone>(a); break;
    case kModeHeavy: local_rows<P, C, HasAnchor, HasControl, kModeHeavy>(a); break;
    case kModeNesterov: local_rows<P, C, HasAnchor, HasControl, kModeNesterov>(a); break;
    case kModeMass: local_rows<P, C, HasAnchor, HasControl, kModeMass>(a); break;
    default: throw std::invalid_argument("fastagg._C.local_step: unknown momentum mode");
  }
}

}  // namespace

void local_step(const LocalArgs& a) {
  if (a.rule != kRuleFixed && a.rule != kRuleSps) throw std::invalid_argument("fastagg._C.local_step: unknown rule");
  dispatch_dtype(a.dtype, [&](auto ptag) {
    using P = decltype(ptag);
    using C = compute_t<P>;
    const bool anchor = a.anchor_ptrs != nullptr, control = a.control != nullptr;
    if (anchor && control) with_mode<P, C, true, true>(a);
    else if (anchor) with_mode<P, C, true, false>(a);
    else if (control) with_mode<P, C, false, true>(a);
    else with_mode<P, C, false, false>(a);
  });
}

}  // namespace fastagg
