// Apply passes of the server rules, once the round's scalars are known. Each reads the mean, the rule's
// state and the parameters once and writes state and parameters once. Parameters and state are written only
// when the round's finite flag is set, so a round with a bad client touches neither, and never with a value that
// is not finite (such an element keeps its old values and is counted).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "convert.h"
#include "kernels.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr int64_t kApplyBlock = 1 << 15;

// An element's new values are stored only if every one is finite in the dtype it is stored in (convert.h);
// otherwise the element keeps all its old values (so an element already Inf/NaN stays as it was) and, unless its
// old values were already not finite (the caller's), it is counted in *overflow.
template <typename C> using lane_int_t = std::conditional_t<sizeof(C) == 4, int32_t, int64_t>;

// The count is an integer of the lanes' width, summed under ivdep: with an `omp simd reduction` clause GCC 12
// emitted scalar code for the whole loop (4-6x slower apply passes, measured), and a float count sums in order.
// Elements that were not finite before are only known once a block counted some, so they are subtracted then.
template <typename P, typename C>
inline void count_overflow(int32_t* counter, lane_int_t<C> kept, const P* w, const C* s1, const C* s2,
                           const C* s3, int64_t n) {
  if (kept == 0) return;
  for (int64_t j = 0; j < n; ++j) {
    bool before = finite_c(load<C>(w + j));
    for (const C* s : {s1, s2, s3}) before = before && (s == nullptr || finite_c(s[j]));
    kept -= !before;
  }
  if (kept > 0) {
#pragma omp atomic
    *counter += static_cast<int32_t>(kept);
  }
}

// Momentum family (plain step, FedAvgM, Nesterov, FedACG, FedExP-M):
//   u = momentum * buf + mean (u = mean without buf);  step = nesterov ? mean + momentum * u : u
//   w <- w + lr * step;  buf <- u;  extra = w_new + extra_coef * u
// Not finite: w and buf unchanged; extra = w + extra_coef_skip * buf, or untouched without extra_coef_skip.
// With start_ptrs, "w" on the right is start's (read there), and an unchanged w is start's copied.
template <typename P, typename C, bool HasBuf, bool HasExtra, bool Nesterov, bool Finite, bool Scaled>
void momentum_impl(const MomentumArgs& a) {
  const C lr = Finite ? static_cast<C>(*a.lr) : C(0);
  const C scale = Scaled ? static_cast<C>(*a.mean_scale) : C(1);
  const C coef = HasExtra ? static_cast<C>(Finite ? *a.extra_coef : *a.extra_coef_skip) : C(0);
  const C mu = static_cast<C>(a.momentum);
  // bytes per column: params and mean, the buffer and the extra output when present (read and written)
  const int64_t bytes = 2 * sizeof(P) + sizeof(C) + (HasBuf ? 2 * sizeof(C) : 0) + (HasExtra ? sizeof(P) : 0);
  parallel_blocks(a.num_segments, a.seg_len, a.seg_off, kApplyBlock, bytes, [&](const Block& blk, int64_t col0) {
    P* w = as_ptr<P>(a.param_ptrs[blk.seg]) + blk.start;
    const P* w_old = a.start_ptrs ? as_ptr<P>(a.start_ptrs[blk.seg]) + blk.start : w;
    P* ex = HasExtra ? as_ptr<P>(a.extra_ptrs[blk.seg]) + blk.start : nullptr;
    const C* m = static_cast<const C*>(a.mean) + col0;
    C* buf = HasBuf ? static_cast<C*>(a.buf) + col0 : nullptr;
    lane_int_t<C> kept = 0;
#pragma GCC ivdep
    for (int64_t j = 0; j < blk.len; ++j) {
      const C w0 = load<C>(w_old + j);
      if constexpr (Finite) {
        const C mj = Scaled ? C(0) + scale * m[j] : m[j];
        const C b0 = HasBuf ? buf[j] : C(0);
        const C u = HasBuf ? mu * b0 + mj : mj;
        const C step = Nesterov ? mj + mu * u : u;
        const C wn = w0 + lr * step;
        const C en = HasExtra ? wn + coef * u : C(0);
        const bool good = stays_finite<P>(wn) & finite_c(u) & (!HasExtra | stays_finite<P>(en));
        store(w + j, good ? wn : w0);
        if constexpr (HasBuf) buf[j] = good ? u : b0;
        if constexpr (HasExtra) store(ex + j, good ? en : w0);  // a kept element's eval value: its param
        kept += !good;
      } else {
        if constexpr (HasExtra) {
          const C en = HasBuf ? w0 + coef * buf[j] : w0;
          const bool good = stays_finite<P>(en);
          store(ex + j, good ? en : w0);
          kept += !good;
        }
      }
    }
    if (!Finite && w_old != w) std::copy(w_old, w_old + blk.len, w);
    count_overflow<P, C>(a.overflow, kept, w_old, buf, nullptr, nullptr, blk.len);
  });
}

// Adam family (FedAdam, FedYogi, FedAdagrad, FedAMS):
//   m <- b1 m + (1 - b1) mean            (Adagrad: m = mean, no buffer)
//   v <- b2 v + (1 - b2) mean^2          (Adam, AMS)
//   v <- v - (1 - b2) mean^2 sign(v - mean^2)   (Yogi)
//   v <- v + mean^2                      (Adagrad)
//   vhat <- max(vhat, v, ams_eps)        (AMS; the denominator uses vhat)
//   w <- w + lr * m / (sqrt(v or vhat) + tau)
template <typename P, typename C, int Rule>
void adam_impl(const AdamArgs& a) {
  const C lr = static_cast<C>(*a.lr);
  const C b1 = static_cast<C>(a.beta1), b2 = static_cast<C>(a.beta2), tau = static_cast<C>(a.tau);
  const C ams_eps = static_cast<C>(a.ams_eps);
  const int64_t bytes = 2 * sizeof(P) + 5 * sizeof(C);  // params, mean, two moments read and written
  parallel_blocks(a.num_segments, a.seg_len, a.seg_off, kApplyBlock, bytes, [&](const Block& blk, int64_t col0) {
    P* w = as_ptr<P>(a.param_ptrs[blk.seg]) + blk.start;
    const C* g = static_cast<const C*>(a.mean) + col0;
    C* m = Rule == kAdagrad ? nullptr : static_cast<C*>(a.m) + col0;
    C* v = static_cast<C*>(a.v) + col0;
    C* vh = Rule == kAms ? static_cast<C*>(a.vhat) + col0 : nullptr;
    lane_int_t<C> kept = 0;
#pragma GCC ivdep
    for (int64_t j = 0; j < blk.len; ++j) {
      const C gj = g[j], g2 = gj * gj;
      C mj = gj;
      if constexpr (Rule != kAdagrad) mj = b1 * m[j] + (C(1) - b1) * gj;
      C vj = v[j];
      if constexpr (Rule == kAdam || Rule == kAms) vj = b2 * vj + (C(1) - b2) * g2;
      if constexpr (Rule == kYogi) vj = vj - (C(1) - b2) * g2 * (C(vj > g2) - C(vj < g2));
      if constexpr (Rule == kAdagrad) vj = vj + g2;
      C denom_sq = vj;
      if constexpr (Rule == kAms) denom_sq = std::max(std::max(vh[j], vj), ams_eps);
      const C w0 = load<C>(w + j);
      const C wn = w0 + lr * mj / (std::sqrt(denom_sq) + tau);
      const bool good = stays_finite<P>(wn) & finite_c(mj) & finite_c(vj) & finite_c(denom_sq);
      if constexpr (Rule != kAdagrad) m[j] = good ? mj : m[j];
      v[j] = good ? vj : v[j];
      if constexpr (Rule == kAms) vh[j] = good ? denom_sq : vh[j];
      store(w + j, good ? wn : w0);
      kept += !good;
    }
    count_overflow<P, C>(a.overflow, kept, w, m, v, vh, blk.len);
  });
}

template <typename F> void dispatch_param_and_compute(int param_dtype, int compute_dtype, F&& f) {
  dispatch_dtype(param_dtype, [&](auto ptag) {
    if (compute_dtype == kFloat64) f(ptag, double{});
    else f(ptag, float{});
  });
}

}  // namespace

void momentum_apply(const MomentumArgs& a) {
  const bool finite = *a.finite;
  // not finite: extra is written only with extra_coef_skip (else left as it is)
  const bool has_extra = a.extra_ptrs != nullptr && (finite || a.extra_coef_skip != nullptr);
  if (!finite && !has_extra && a.start_ptrs == nullptr) return;
  dispatch_param_and_compute(a.param_dtype, a.compute_dtype, [&](auto ptag, auto ctag) {
    using P = decltype(ptag);
    using C = decltype(ctag);
    const bool has_buf = a.buf != nullptr;
    // Finite x buf x extra x nesterov, each a compile-time branch of the inner loop.
    using T = std::true_type;
    using F = std::false_type;
    auto go = [&](auto fin, auto buf, auto ext, auto nes) {
      constexpr bool Fin = decltype(fin)::value, Buf = decltype(buf)::value, Ext = decltype(ext)::value,
                     Nes = decltype(nes)::value;
      if constexpr (Fin) {  // (a round that is not finite reads no mean)
        if (a.mean_scale) momentum_impl<P, C, Buf, Ext, Nes, true, true>(a);
        else momentum_impl<P, C, Buf, Ext, Nes, true, false>(a);
      } else {
        momentum_impl<P, C, Buf, Ext, Nes, false, false>(a);
      }
    };
    auto with_nes = [&](auto fin, auto buf, auto ext) {
      if (a.nesterov) go(fin, buf, ext, T{});
      else go(fin, buf, ext, F{});
    };
    auto with_ext = [&](auto fin, auto buf) {
      if (has_extra) with_nes(fin, buf, T{});
      else with_nes(fin, buf, F{});
    };
    auto with_buf = [&](auto fin) {
      if (has_buf) with_ext(fin, T{});
      else with_ext(fin, F{});
    };
    if (finite) with_buf(T{});
    else with_buf(F{});
  });
}

void adam_apply(const AdamArgs& a) {
  if (!*a.finite) return;
  dispatch_param_and_compute(a.param_dtype, a.compute_dtype, [&](auto ptag, auto ctag) {
    using P = decltype(ptag);
    using C = decltype(ctag);
    switch (a.rule) {
      case kAdam: adam_impl<P, C, kAdam>(a); break;
      case kYogi: adam_impl<P, C, kYogi>(a); break;
      case kAdagrad: adam_impl<P, C, kAdagrad>(a); break;
      case kAms: adam_impl<P, C, kAms>(a); break;
      default: throw std::invalid_argument("fastagg._C.adam_apply: unknown rule");
    }
  });
}

}  // namespace fastagg
