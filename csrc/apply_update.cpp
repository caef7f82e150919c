// Apply pass: once eta is known, w <- w + eta * mean, optionally also writing the
// evaluation model w_new - eval_scale * eta * mean. Parameters are written only when the round's
// finite flag is set, so a round with a bad client never touches them; eval is then a copy of w.
#include "kernels.h"

#include "convert.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr int64_t kApplyBlock = 1 << 15;

template <typename P, typename C, bool HasEval, bool Finite>
void apply_update_impl(const ApplyArgs& a) {
  const C eta = Finite ? static_cast<C>(*a.eta) : C(0);
  const C eval_coef = Finite ? static_cast<C>(a.eval_scale * *a.eta) : C(0);
  const std::vector<Block> blocks = make_blocks(a.num_segments, a.seg_len, kApplyBlock);
  const int64_t nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const Block blk = blocks[b];
    P* w = as_ptr<P>(a.param_ptrs[blk.seg]) + blk.start;
    P* ev = HasEval ? as_ptr<P>(a.eval_ptrs[blk.seg]) + blk.start : nullptr;
    const C* m = static_cast<const C*>(a.mean) + a.seg_off[blk.seg] + blk.start;
#pragma omp simd
    for (int64_t j = 0; j < blk.len; ++j) {
      if constexpr (Finite) {
        const C w_new = load<C>(w + j) + eta * m[j];
        store(w + j, w_new);
        if constexpr (HasEval) store(ev + j, w_new - eval_coef * m[j]);
      } else {
        ev[j] = w[j];
      }
    }
  }
}

}  // namespace

void apply_update(const ApplyArgs& a) {
  const bool finite = *a.finite;
  if (!finite && !a.eval_ptrs) return;
  dispatch_dtype(a.param_dtype, [&](auto tag) {
    using P = decltype(tag);
    auto run = [&](auto ctag) {
      using C = decltype(ctag);
      if (!finite) apply_update_impl<P, C, true, false>(a);
      else if (a.eval_ptrs) apply_update_impl<P, C, true, true>(a);
      else apply_update_impl<P, C, false, true>(a);
    };
    if (a.mean_dtype == kFloat64) run(double{});
    else run(float{});
  });
}

}  // namespace fastagg
