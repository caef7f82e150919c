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
#include <cmath>
#include <limits>
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
// Few long rows are swept by all threads together (one barrier per row); otherwise one thread per row. Measured on
// the 2-core VM, M = 100 x d = 1e5: both schedules 4.2-4.6 ms (the shared split gained nothing from keeping each
// thread's half-row in L2), so the shared one is kept only for batches too small to occupy every thread.
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

// The row pieces both schedules share: a block's squared-norm partial, the row's scalars, a block's update.
template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
struct Row {
  using Dir = Direction<P, C, HasAnchor, HasControl>;
  P* x;
  Dir dir;
  C* buf;
  bool first;

  Row(const LocalArgs& a, int64_t i)
      : x(as_ptr<P>(a.x_ptrs[i])),
        dir{x, as_ptr<const P>(a.g_ptrs[i]), HasAnchor ? as_ptr<const P>(a.anchor_ptrs[i]) : nullptr,
            HasControl ? static_cast<const C*>(a.control) : nullptr,
            HasControl ? as_ptr<const C>(a.ci_ptrs[i]) : nullptr, static_cast<C>(a.prox)},
        buf(Mode != kModeNone ? as_ptr<C>(a.buf_ptrs[i]) : nullptr),
        first(Mode == kModeMass && a.first != nullptr && a.first[i] != 0) {}

  // Sixteen independent lanes: a single accumulator chains every add on its latency.
  double block_sq(int64_t b0, int64_t end) const {
    C lanes[kLanes] = {};
    int64_t j = b0;
    for (; j + kLanes <= end; j += kLanes) {
#pragma omp simd
      for (int k = 0; k < kLanes; ++k) {
        const C v = dir(j + k);
        lanes[k] += v * v;
      }
    }
    C part = 0;
    for (int k = 0; k < kLanes; ++k) part += lanes[k];
    for (; j < end; ++j) {
      const C v = dir(j);
      part += v * v;
    }
    return static_cast<double>(part);
  }

  void update_block(int64_t b0, int64_t end, double step, double scale, const LocalArgs& a) {
    const C st = static_cast<C>(step), sc = static_cast<C>(scale), wd = static_cast<C>(a.weight_decay);
    const C mu = static_cast<C>(a.momentum), eta2 = static_cast<C>(a.eta2);
    const C keep = C(1) - st * wd, move = st * sc;
#pragma omp simd
    for (int64_t j = b0; j < end; ++j) {
      const C xj = load<C>(x + j);
      if constexpr (Mode == kModeNone) {
        store(x + j, keep * xj - move * dir(j));  // = x - step (scale dir + wd x), two multiplies
      } else {
        const C dj = sc * dir(j) + wd * xj;
        if constexpr (Mode == kModeHeavy) {
          const C bj = mu * buf[j] + dj;
          buf[j] = bj;
          store(x + j, xj - st * bj);
        } else if constexpr (Mode == kModeNesterov) {
          const C bj = mu * buf[j] + dj;
          buf[j] = bj;
          store(x + j, xj - st * (dj + mu * bj));
        } else {
          const C w = xj - st * dj;
          store(x + j, w + mu * (w - (first ? xj : buf[j])) + eta2 * dj);
          buf[j] = w;
        }
      }
    }
  }
};

// The row's clip scale and step from its squared direction norm s; writes step_out / sq_out. Returns the step.
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
  if (!std::isfinite(step) || step <= 0) step = 0;
  *scale_out = scale;
  return step;
}

inline void record(const LocalArgs& a, int64_t i, double step, double s, double scale) {
  a.step_out[i] = step;
  a.sq_out[i] = s * scale * scale;
}

// One thread per row (short rows).
template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
void rows_per_thread(const LocalArgs& a) {
  const int64_t d = a.numel;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < a.num_rows; ++i) {
    Row<P, C, HasAnchor, HasControl, Mode> row(a, i);
    double s = 0;
    for (int64_t b0 = 0; b0 < d; b0 += kLocalBlock) s += row.block_sq(b0, std::min(d, b0 + kLocalBlock));
    double scale;
    const double step = row_step(a, i, s, &scale);
    record(a, i, step, s, scale);
    if (step == 0) continue;
    for (int64_t b0 = 0; b0 < d; b0 += kLocalBlock) row.update_block(b0, std::min(d, b0 + kLocalBlock), step, scale, a);
  }
}

// All threads on each row (long rows): the same static split of the row's blocks in both sweeps, so each thread
// updates the blocks whose gradient it just read. Block partials are summed in block order: the result does not
// depend on the thread count. Partials alternate between two buffers, so a thread that runs ahead into the next
// row cannot overwrite what a slower one is still summing.
template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
void rows_shared(const LocalArgs& a) {
  const int64_t d = a.numel, nb = (d + kLocalBlock - 1) / kLocalBlock;
  std::vector<double> parts(2 * nb);
#pragma omp parallel
  {
    for (int64_t i = 0; i < a.num_rows; ++i) {
      Row<P, C, HasAnchor, HasControl, Mode> row(a, i);
      double* part = parts.data() + (i % 2) * nb;
#pragma omp for schedule(static)
      for (int64_t b = 0; b < nb; ++b) part[b] = row.block_sq(b * kLocalBlock, std::min(d, (b + 1) * kLocalBlock));
      double s = 0;
      for (int64_t b = 0; b < nb; ++b) s += part[b];
      double scale;
      const double step = row_step(a, i, s, &scale);
#pragma omp single nowait
      record(a, i, step, s, scale);
      if (step == 0) continue;
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < nb; ++b) row.update_block(b * kLocalBlock, std::min(d, (b + 1) * kLocalBlock), step, scale, a);
    }
  }
}

template <typename P, typename C, bool HasAnchor, bool HasControl, int Mode>
void local_rows(const LocalArgs& a) {
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  if (threads > 1 && a.num_rows < 4 * threads && a.numel * static_cast<int64_t>(sizeof(P)) >= kSharedRowBytes)
    rows_shared<P, C, HasAnchor, HasControl, Mode>(a);
  else
    rows_per_thread<P, C, HasAnchor, HasControl, Mode>(a);
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
