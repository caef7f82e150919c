// The two passes of Byzantine-robust aggregation (fastagg/robust.py holds the rules; this file only reads rows).
//
// Coordinate-select: kLanes adjacent columns are sorted side by side. Row i's kLanes values are one short vector
// (no transpose: the rows are the clients), and a sorting network over the M rows is a fixed list of
// compare-exchanges (a, b), each an elementwise min/max of two such vectors, so every coordinate of the tile is
// sorted at once in SIMD lanes. The network is Batcher's odd-even merge sort for the next power of two; a
// comparator that touches a row >= M is dropped (such rows would hold +inf, which no comparator moves). The
// reduction then reads fixed sorted positions (median, trimmed mean) or the values nearest the median (MeaMed).
// Values are sorted in the rows' type upcast to float (float64 rows, or any rows formed against a base, in
// float64 -- the difference of two float32 values is exact there), order statistics are exact, means are summed
// in float64.
//
// Gram: a block of columns of every row is upcast to float64 into a per-thread buffer, then G's upper triangle is
// accumulated by a 4 x 2 register tile (six loads per eight multiply-adds). Blocks are grouped into chunks by size
// alone and the chunks summed in order, so G is bit-identical for any thread count.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>  // integer_sequence
#include <vector>

#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include "convert.h"
#include "segments.h"

namespace fastagg {
namespace {

constexpr int kLanes = 16;              // columns sorted side by side
constexpr int64_t kSelectBlock = 4096;  // columns per parallel block (per-row squared-norm partials per block)
constexpr int64_t kNetworkMax = 1024;   // more clients: each lane is sorted by std::sort instead
constexpr int64_t kPrefetch = 1024;     // elements ahead in each row (of 0, 256, 1024: the best here, ~5-10%)

// Batcher's odd-even merge sort on n = 2^p >= M inputs: calls f(a, b) for each comparator (a < b: the minimum goes
// to a), dropping those that touch b >= M.
template <typename F>
constexpr void for_each_comparator(int M, F&& f) {
  int n = 1;
  while (n < M) n <<= 1;
  for (int p = 1; p < n; p <<= 1)
    for (int k = p; k >= 1; k >>= 1)
      for (int j = k % p; j + k < n; j += 2 * k)
        for (int i = 0; i < (k < n - j - k ? k : n - j - k); ++i)
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p) && i + j + k < M) f(i + j, i + j + k);
}

using Network = std::vector<std::pair<int32_t, int32_t>>;

Network sorting_network(int64_t M) {
  Network net;
  for_each_comparator(static_cast<int>(M), [&](int a, int b) { net.emplace_back(a, b); });
  return net;
}

// The network for a compile-time M (up to kFixedMax): fully unrolled over a local copy of the tile, which the
// compiler keeps in vector registers (measured, M = 16 float32: the run-time network spent its time loading and
// storing the tile).
constexpr int kFixedMax = 32;

template <int M>
struct FixedNetwork {
  int first[M * 32] = {}, second[M * 32] = {};  // enough: Batcher's network for 32 inputs has 191 comparators
  int size = 0;
  constexpr FixedNetwork() {
    for_each_comparator(M, [this](int a, int b) {
      first[size] = a;
      second[size++] = b;
    });
  }
};

template <int M>
inline constexpr FixedNetwork<M> kNet{};

// One vector register of lanes as a GCC/Clang vector value: the compare-exchanges below then compile to vector
// min/max on any build (a plain loop of std::min was left scalar). 256 bits with AVX; 128 on the portable build,
// where a 256-bit value made GCC split every operation in two and took 130 s to compile this file (now seconds).
template <typename V>
struct VecReg {
#ifdef __AVX__
  typedef V type __attribute__((vector_size(32)));
#else
  typedef V type __attribute__((vector_size(16)));
#endif
};

template <typename X>
inline void compare_exchange(X& x, X& y) {
  const X a = x, b = y;
#ifdef __AVX__  // vminps/vmaxps: two instructions where the select form takes a compare and two blends
  if constexpr (sizeof(a[0]) == 4) {
    x = (X)_mm256_min_ps((__m256)a, (__m256)b);
    y = (X)_mm256_max_ps((__m256)a, (__m256)b);
  } else {
    x = (X)_mm256_min_pd((__m256d)a, (__m256d)b);
    y = (X)_mm256_max_pd((__m256d)a, (__m256d)b);
  }
#elif defined(__SSE2__)  // the portable x86-64 build: the same min/max on 128 bits (the select form below compiled
                        // to and/andnot/or triples, and the file took 40 s longer to compile)
  if constexpr (sizeof(a[0]) == 4) {
    x = (X)_mm_min_ps((__m128)a, (__m128)b);
    y = (X)_mm_max_ps((__m128)a, (__m128)b);
  } else {
    x = (X)_mm_min_pd((__m128d)a, (__m128d)b);
    y = (X)_mm_max_pd((__m128d)a, (__m128d)b);
  }
#else
  x = b < a ? b : a;
  y = b < a ? a : b;
#endif
}

template <typename X, int M, int... C>
inline void run_network(X (&r)[M], std::integer_sequence<int, C...>) {
  (compare_exchange(r[kNet<M>.first[C]], r[kNet<M>.second[C]]), ...);
}

template <typename V, int M>
__attribute__((noinline)) void sort_fixed(V* tile) {  // one copy per (V, M), not one per caller
  using X = typename VecReg<V>::type;
  constexpr int H = sizeof(X) / sizeof(V);
  for (int h = 0; h < kLanes; h += H) {
    X r[M];
    for (int i = 0; i < M; ++i) std::memcpy(&r[i], tile + i * kLanes + h, sizeof(X));
    run_network<X, M>(r, std::make_integer_sequence<int, kNet<M>.size>{});
    for (int i = 0; i < M; ++i) std::memcpy(tile + i * kLanes + h, &r[i], sizeof(X));
  }
}

// sort_fixed<V, M> for the run-time m, if 2 <= m <= kFixedMax; false otherwise.
template <typename V, int M = 2>
inline bool sort_fixed_for(V* tile, int64_t m) {
  if constexpr (M > kFixedMax) {
    return false;
  } else {
    if (m == M) {
      sort_fixed<V, M>(tile);
      return true;
    }
    return sort_fixed_for<V, M + 1>(tile, m);
  }
}

template <typename V>
inline void sort_tile(V* tile, int64_t M, const Network& net, std::vector<V>& scratch) {
  if (M <= kFixedMax) {
    if (M > 1) sort_fixed_for<V>(tile, M);
    return;
  }
  if (M > kNetworkMax) {
    for (int w = 0; w < kLanes; ++w) {
      for (int64_t i = 0; i < M; ++i) {  // NaN as +inf: std::sort needs a strict weak order (a NaN breaks it and
        const V v = tile[i * kLanes + w];  // may send the sort outside the range); a round with one is redone anyway
        scratch[i] = v == v ? v : std::numeric_limits<V>::infinity();
      }
      std::sort(scratch.begin(), scratch.begin() + M);
      for (int64_t i = 0; i < M; ++i) tile[i * kLanes + w] = scratch[i];
    }
    return;
  }
  for (const auto& [a, b] : net) {
    V* pa = tile + a * kLanes;
    V* pb = tile + b * kLanes;
#pragma omp simd
    for (int w = 0; w < kLanes; ++w) {
      const V x = pa[w], y = pb[w];
      pa[w] = std::min(x, y);
      pb[w] = std::max(x, y);
    }
  }
}

// kLanes values of one row (n of them real, the rest zero) into the tile; their squares added to the row's
// per-lane float64 sums (summed across lanes once per block, not once per tile).
template <typename T, typename V, bool HasBase>
inline void load_lanes(const T* x, const T* base, int64_t n, V* t, double* sq) {
  if (n == kLanes) {
#pragma omp simd
    for (int w = 0; w < kLanes; ++w) {
      const V v = load<V>(x + w) - (HasBase ? load<V>(base + w) : V(0));
      t[w] = v;
      sq[w] += double(v) * double(v);
    }
  } else {
    for (int w = 0; w < kLanes; ++w) {
      const V v = w < n ? load<V>(x + w) - (HasBase ? load<V>(base + w) : V(0)) : V(0);
      t[w] = v;
      sq[w] += double(v) * double(v);
    }
  }
}

// The selected mean of each sorted lane into out[0..n).
template <typename V, typename O>
inline void reduce_tile(const V* tile, int64_t M, const SelectArgs& a, int64_t n, O* out) {
  double acc[kLanes] = {};
  if (a.rule == kSelectWindow) {
    for (int64_t p = a.first; p < a.first + a.count; ++p) {
      const V* row = tile + p * kLanes;
#pragma omp simd
      for (int w = 0; w < kLanes; ++w) acc[w] += double(row[w]);
    }
  } else {
    // The count values nearest the median are a window [lo, lo + count) of the sorted values: dropping the farther
    // end f = M - count times (a tie drops the upper end) leaves lo = #{t < f : med - s[t] > s[M - f + t] - med}
    // (the lower distances fall and the upper ones rise with t, so this counts the steps that drop the lower end).
    // Four lanes at a time as one 256-bit float64 vector value (a per-lane loop with selects stayed scalar, and
    // 512-bit vector values compiled to scalar shuffles on an AVX2 build).
    typedef V VecV __attribute__((vector_size(4 * sizeof(V))));
    typedef double Vec4 __attribute__((vector_size(32)));
    const int64_t f = M - a.count;
    for (int h = 0; h < kLanes; h += 4) {
      auto row = [&](int64_t p) {
        VecV v;
        std::memcpy(&v, tile + p * kLanes + h, sizeof(v));
        return __builtin_convertvector(v, Vec4);
      };
      const Vec4 zero = {}, one = zero + 1.0;
      const Vec4 med = M % 2 ? row((M - 1) / 2) : 0.5 * (row(M / 2 - 1) + row(M / 2));
      Vec4 lo = zero, sum = zero;
      for (int64_t t = 0; t < f; ++t) lo += med - row(t) > row(M - f + t) - med ? one : zero;
      const Vec4 hi = lo + double(a.count);
      for (int64_t p = 0; p < M; ++p) {
        const Vec4 pos = zero + double(p);
        sum += (pos >= lo) & (pos < hi) ? row(p) : zero;
      }
      std::memcpy(acc + h, &sum, sizeof(sum));
    }
  }
  for (int64_t w = 0; w < n; ++w) out[w] = static_cast<O>(acc[w] / double(a.count));
}

template <typename T, typename C, bool HasBase>
bool row_has_nonfinite(const uint64_t* row_ptrs, const uint64_t* base_ptrs, const int64_t* seg_len, int64_t L,
                       int64_t M, int64_t i) {
  for (int64_t s = 0; s < L; ++s) {
    const T* x = as_ptr<const T>(row_ptrs[s * M + i]);
    const T* b = HasBase ? as_ptr<const T>(base_ptrs[s]) : nullptr;
    for (int64_t j = 0; j < seg_len[s]; ++j) {
      const C v = load<C>(x + j) - (HasBase ? load<C>(b + j) : C(0));
      if (!(v - v == C(0))) return true;
    }
  }
  return false;
}

template <typename T, typename V, typename O, bool HasBase>
void coord_select_impl(const SelectArgs& a) {
  const int64_t M = a.num_clients, L = a.num_segments;
  const std::vector<Block> blocks = make_blocks(L, a.seg_len, kSelectBlock);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const Network net = M <= kNetworkMax ? sorting_network(M) : Network{};
  std::vector<double> part_sq(nb * M);
  int64_t numel = 0;
  for (int64_t s = 0; s < L; ++s) numel += a.seg_len[s];
#pragma omp parallel num_threads(threads_for(numel * M * int64_t(sizeof(T))))
  {
    std::vector<V> tile(M * kLanes), scratch(M > kNetworkMax ? M : 0);
    std::vector<double> lanes_sq(M * kLanes);
    std::vector<const T*> x(M);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const Block blk = blocks[b];
      const T* base = HasBase ? as_ptr<const T>(a.base_ptrs[blk.seg]) + blk.start : nullptr;
      for (int64_t i = 0; i < M; ++i) x[i] = as_ptr<const T>(a.row_ptrs[blk.seg * M + i]) + blk.start;
      O* out = static_cast<O*>(a.out) + a.seg_off[blk.seg] + blk.start;
      std::fill(lanes_sq.begin(), lanes_sq.end(), 0.0);
      for (int64_t c = 0; c < blk.len; c += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, blk.len - c);
        for (int64_t i = 0; i < M; ++i) {
          __builtin_prefetch(x[i] + c + kPrefetch);
          load_lanes<T, V, HasBase>(x[i] + c, HasBase ? base + c : nullptr, n, tile.data() + i * kLanes,
                                    lanes_sq.data() + i * kLanes);
        }
        sort_tile(tile.data(), M, net, scratch);
        reduce_tile<V, O>(tile.data(), M, a, n, out + c);
      }
      for (int64_t i = 0; i < M; ++i) {
        double s = 0;
        for (int w = 0; w < kLanes; ++w) s += lanes_sq[i * kLanes + w];
        part_sq[b * M + i] = s;
      }
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    double s = 0;
    for (int64_t b = 0; b < nb; ++b) s += part_sq[b * M + i];
    a.sq_norms_out[i] = s;
    a.nonfinite_out[i] = std::isfinite(s) ? 0 : row_has_nonfinite<T, V, HasBase>(a.row_ptrs, a.base_ptrs,
                                                                                  a.seg_len, L, M, i);
  }
}

// ---- Gram ------------------------------------------------------------------------------------------------------

constexpr int64_t kGramBlock = 512;  // columns per block: M x 512 float64 per thread (64 KiB at M = 16)

// out[r * 2 + c] += <a_r, b_c> over n columns, for rows a_0..a_3 (stride ld) and b_0, b_1.
inline void dot4x2(const double* a, const double* b, int64_t ld, int64_t n, double* out) {
  const double *a0 = a, *a1 = a + ld, *a2 = a + 2 * ld, *a3 = a + 3 * ld, *b0 = b, *b1 = b + ld;
  double s00 = 0, s01 = 0, s10 = 0, s11 = 0, s20 = 0, s21 = 0, s30 = 0, s31 = 0;
#pragma omp simd reduction(+ : s00, s01, s10, s11, s20, s21, s30, s31)
  for (int64_t j = 0; j < n; ++j) {
    const double y0 = b0[j], y1 = b1[j];
    s00 += a0[j] * y0;
    s01 += a0[j] * y1;
    s10 += a1[j] * y0;
    s11 += a1[j] * y1;
    s20 += a2[j] * y0;
    s21 += a2[j] * y1;
    s30 += a3[j] * y0;
    s31 += a3[j] * y1;
  }
  out[0] += s00, out[1] += s01, out[2] += s10, out[3] += s11;
  out[4] += s20, out[5] += s21, out[6] += s30, out[7] += s31;
}

template <typename T, bool HasBase>
void gram_impl(const GramArgs& a) {
  const int64_t M = a.num_clients, L = a.num_segments;
  const int64_t Mp = (M + 3) / 4 * 4;  // rows padded to the tile; padded rows stay zero
  const std::vector<Block> blocks = make_blocks(L, a.seg_len, kGramBlock);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const int64_t per = std::max<int64_t>(64, (nb + 255) / 256);  // blocks per chunk: a function of the size alone
  const int64_t nchunks = (nb + per - 1) / per;
  std::vector<double> part(std::max<int64_t>(nchunks, 1) * Mp * Mp, 0.0);
  int64_t numel = 0;
  for (int64_t s = 0; s < L; ++s) numel += a.seg_len[s];
#pragma omp parallel num_threads(threads_for(numel * M * int64_t(sizeof(T))))
  {
    std::vector<double> xb(Mp * kGramBlock, 0.0);
    double tile[8];
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      double* g = part.data() + ch * Mp * Mp;
      for (int64_t b = ch * per; b < std::min(nb, (ch + 1) * per); ++b) {
        const Block blk = blocks[b];
        const int64_t n = blk.len;
        const T* base = HasBase ? as_ptr<const T>(a.base_ptrs[blk.seg]) + blk.start : nullptr;
        for (int64_t i = 0; i < M; ++i) {
          const T* x = as_ptr<const T>(a.row_ptrs[blk.seg * M + i]) + blk.start;
          double* dst = xb.data() + i * kGramBlock;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) dst[j] = load<double>(x + j) - (HasBase ? load<double>(base + j) : 0.0);
        }
        for (int64_t I = 0; I < Mp; I += 4)
          for (int64_t J = I; J < Mp; J += 2) {
            std::fill(tile, tile + 8, 0.0);
            dot4x2(xb.data() + I * kGramBlock, xb.data() + J * kGramBlock, kGramBlock, n, tile);
            for (int r = 0; r < 4; ++r)
              for (int c = 0; c < 2; ++c) g[(I + r) * Mp + J + c] += tile[r * 2 + c];
          }
      }
    }
  }
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = i; j < M; ++j) {
      double s = 0;
      for (int64_t ch = 0; ch < nchunks; ++ch) s += part[ch * Mp * Mp + i * Mp + j];
      a.gram_out[i * M + j] = s;
      a.gram_out[j * M + i] = s;
    }
  for (int64_t i = 0; i < M; ++i)
    a.nonfinite_out[i] = std::isfinite(a.gram_out[i * M + i])
                             ? 0
                             : row_has_nonfinite<T, double, HasBase>(a.row_ptrs, a.base_ptrs, a.seg_len, L, M, i);
}

}  // namespace

void coord_select(const SelectArgs& a) {
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto otag) {
      using O = decltype(otag);
      if (a.base_ptrs) coord_select_impl<T, double, O, true>(a);
      else if constexpr (std::is_same_v<T, double>) coord_select_impl<T, double, O, false>(a);
      else coord_select_impl<T, float, O, false>(a);
    };
    if (a.out_dtype == kFloat64) go(double{});
    else go(float{});
  });
}

void gram(const GramArgs& a) {
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (a.base_ptrs) gram_impl<T, true>(a);
    else gram_impl<T, false>(a);
  });
}

}  // namespace fastagg
