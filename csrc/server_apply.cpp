// Apply passes of the server rules, once the round's scalars are known. Each reads the mean, the rule's
// state and the parameters once and writes state and parameters once. Parameters and state are written only
// when the round's finite flag is set, so a round with a bad client touches neither, and never with a value that
// is not finite (such an element keeps its old values and is counted).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "convert.h"
#include "kernels.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr int64_t kApplyBlock = 1 << 15;

// An element's new values are stored only if every one is finite in the dtype it is stored in (convert.h);
// otherwise the element keeps all its old values and is counted (*overflow).

inline void count_overflow(int32_t* counter, int64_t bad) {
  if (bad) {
#pragma omp atomic
    *counter += static_cast<int32_t>(bad);
  }
}

// Momentum family (plain step, FedAvgM, Nesterov, FedACG, FedExP-M):
//   u = momentum * buf + mean (u = mean without buf);  step = nesterov ? mean + momentum * u : u
//   w <- w + lr * step;  buf <- u;  extra = w_new + extra_coef * u
// Not finite: w and buf unchanged; extra = w + extra_coef_skip * buf, or untouched without extra_coef_skip.
template <typename P, typename C, bool HasBuf, bool HasExtra, bool Nesterov, bool Finite>
void momentum_impl(const MomentumArgs& a) {
  const C lr = Finite ? static_cast<C>(*a.lr) : C(0);
  const C coef = HasExtra ? static_cast<C>(Finite ? *a.extra_coef : *a.extra_coef_skip) : C(0);
  const C mu = static_cast<C>(a.momentum);
  parallel_blocks(a.num_segments, a.seg_len, a.seg_off, kApplyBlock, [&](const Block& blk, int64_t col0) {
    P* w = as_ptr<P>(a.param_ptrs[blk.seg]) + blk.start;
    P* ex = HasExtra ? as_ptr<P>(a.extra_ptrs[blk.seg]) + blk.start : nullptr;
    const C* m = static_cast<const C*>(a.mean) + col0;
    C* buf = HasBuf ? static_cast<C*>(a.buf) + col0 : nullptr;
    int64_t bad = 0;
#pragma omp simd reduction(+ : bad)
    for (int64_t j = 0; j < blk.len; ++j) {
      const C w0 = load<C>(w + j);
      if constexpr (Finite) {
        const C u = HasBuf ? mu * buf[j] + m[j] : m[j];
        const C step = Nesterov ? m[j] + mu * u : u;
        const P wp = rounded<P>(w0 + lr * step);
        const C wb = load<C>(&wp);
        bool good = finite_c(wb) && finite_c(u);
        P ep{};
        if constexpr (HasExtra) {
          ep = rounded<P>(wb + coef * u);
          good = good && finite_c(load<C>(&ep));
        }
        // an element already Inf/NaN is the caller's, not an overflow of this step
        good = good || !(finite_c(w0) && (!HasBuf || finite_c(buf[j])));
        if constexpr (HasExtra) ex[j] = pick(good, ep, ex[j]);
        w[j] = pick(good, wp, w[j]);
        if constexpr (HasBuf) buf[j] = good ? u : buf[j];
        bad += !good;
      } else {
        if constexpr (HasExtra) {
          const P ep = rounded<P>(HasBuf ? w0 + coef * buf[j] : w0);
          const bool good = finite_c(load<C>(&ep)) || !(finite_c(w0) && (!HasBuf || finite_c(buf[j])));
          ex[j] = pick(good, ep, ex[j]);
          bad += !good;
        }
      }
    }
    count_overflow(a.overflow, bad);
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
  parallel_blocks(a.num_segments, a.seg_len, a.seg_off, kApplyBlock, [&](const Block& blk, int64_t col0) {
    P* w = as_ptr<P>(a.param_ptrs[blk.seg]) + blk.start;
    const C* g = static_cast<const C*>(a.mean) + col0;
    C* m = Rule == kAdagrad ? nullptr : static_cast<C*>(a.m) + col0;
    C* v = static_cast<C*>(a.v) + col0;
    C* vh = Rule == kAms ? static_cast<C*>(a.vhat) + col0 : nullptr;
    int64_t bad = 0;
#pragma omp simd reduction(+ : bad)
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
      const P wp = rounded<P>(w0 + lr * mj / (std::sqrt(denom_sq) + tau));
      bool old_ok = finite_c(w0) && finite_c(v[j]);
      if constexpr (Rule != kAdagrad) old_ok = old_ok && finite_c(m[j]);
      if constexpr (Rule == kAms) old_ok = old_ok && finite_c(vh[j]);
      const bool good = (finite_c(load<C>(&wp)) && finite_c(mj) && finite_c(denom_sq)) || !old_ok;
      if constexpr (Rule != kAdagrad) m[j] = good ? mj : m[j];
      v[j] = good ? vj : v[j];
      if constexpr (Rule == kAms) vh[j] = good ? denom_sq : vh[j];
      w[j] = pick(good, wp, w[j]);
      bad += !good;
    }
    count_overflow(a.overflow, bad);
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
  const bool has_extra = a.extra_ptrs != nullptr;
  if (!finite && (!has_extra || a.extra_coef_skip == nullptr)) return;
  dispatch_param_and_compute(a.param_dtype, a.compute_dtype, [&](auto ptag, auto ctag) {
    using P = decltype(ptag);
    using C = decltype(ctag);
    const bool has_buf = a.buf != nullptr;
    // Finite x buf x extra x nesterov, each a compile-time branch of the inner loop.
    auto go = [&](auto fin, auto buf, auto ext, auto nes) {
      momentum_impl<P, C, decltype(buf)::value, decltype(ext)::value, decltype(nes)::value, decltype(fin)::value>(a);
    };
    using T = std::true_type;
    using F = std::false_type;
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
