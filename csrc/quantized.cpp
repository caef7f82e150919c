// int8 blockwise absmax clients folded into a sum (quantized.h). Every pointer here was checked by the binding.
#include "quantized.h"

#include <algorithm>
#include <vector>

#include "segments.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastagg {

namespace {
constexpr int64_t kChunk = int64_t(1) << 16;  // columns per chunk (its partial sums are added in chunk order)
constexpr int64_t kTile = 2048;               // columns kept in L1 while every client is added
}  // namespace

template <typename T>
void int8_blockwise_fold(const int8_t* const* codes, const float* const* scales, int64_t M, int64_t d,
                         int64_t block, const double* coef, const T* init, T* out, double* sq_out,
                         uint8_t* bad_out, double* msq_out) {
  const int64_t chunks = (d + kChunk - 1) / kChunk;
  std::vector<double> part_sq(static_cast<size_t>(chunks * M), 0.0), part_msq(static_cast<size_t>(chunks), 0.0);
  std::vector<uint8_t> part_bad(static_cast<size_t>(chunks * M), 0);
#pragma omp parallel for schedule(static) num_threads(threads_for(d * (M + 2 * int64_t(sizeof(T)))))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t c_lo = c * kChunk, c_hi = std::min(d, c_lo + kChunk);
    double* psq = part_sq.data() + c * M;
    uint8_t* pbad = part_bad.data() + c * M;
    double msq = 0.0;
    T acc[kTile];
    for (int64_t lo = c_lo; lo < c_hi;) {
      // a tile never crosses a block boundary: one scale per client per tile
      const int64_t b = lo / block;
      const int64_t hi = std::min({c_hi, lo + kTile, (b + 1) * block});
      const int64_t n = hi - lo;
      if (init != nullptr) {
        for (int64_t t = 0; t < n; ++t) acc[t] = init[lo + t];
      } else {
        for (int64_t t = 0; t < n; ++t) acc[t] = T(0);
      }
      for (int64_t i = 0; i < M; ++i) {
        const int8_t* q = codes[i] + lo;
        const double s = static_cast<double>(scales[i][b]);
        const T cs = static_cast<T>(coef[i] * s);
        // int32 sums: a tile holds at most kTile codes of |q| <= 128, so sum q^2 <= 2048 * 16384 < 2^31
        int32_t qq = 0;
        int32_t lowest = 0;
#pragma omp simd reduction(+ : qq) reduction(min : lowest)
        for (int64_t t = 0; t < n; ++t) {
          const int32_t v = q[t];
          acc[t] += cs * static_cast<T>(v);
          qq += v * v;
          lowest = v < lowest ? v : lowest;
        }
        psq[i] += s * s * static_cast<double>(qq);
        pbad[i] |= lowest < -127;
      }
      for (int64_t t = 0; t < n; ++t) {
        out[lo + t] = acc[t];
        msq += static_cast<double>(acc[t]) * static_cast<double>(acc[t]);
      }
      lo = hi;
    }
    part_msq[c] = msq;
  }
  double msq = 0.0;
  for (int64_t i = 0; i < M; ++i) {
    sq_out[i] = 0.0;
    bad_out[i] = 0;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    msq += part_msq[c];
    for (int64_t i = 0; i < M; ++i) {
      sq_out[i] += part_sq[c * M + i];
      bad_out[i] |= part_bad[c * M + i];
    }
  }
  *msq_out = msq;
}

template void int8_blockwise_fold<float>(const int8_t* const*, const float* const*, int64_t, int64_t, int64_t,
                                         const double*, const float*, float*, double*, uint8_t*, double*);
template void int8_blockwise_fold<double>(const int8_t* const*, const float* const*, int64_t, int64_t, int64_t,
                                          const double*, const double*, double*, double*, uint8_t*, double*);

}  // namespace fastagg
