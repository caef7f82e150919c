// Clients compressed to int8 blockwise absmax (fastagg/compress/int8.py states the format), folded where they lie.
//
//   out_j  = init_j + sum_i coef_i * scale_i[j / B] * q_ij        (init absent: 0)
//   sq_i   = sum_b scale_ib^2 * sum_{j in b} q_ij^2                 (the inner sum in int64: exact)
//   msq    = sum_j out_j^2                                          (float64; not finite when out overflowed)
//   bad_i  = client i holds a code of -128 (outside the symmetric range [-127, 127])
//
// The per-element product coef_i * scale_ib is formed in float64 and rounded once to the sum's type T.
// Results never depend on the thread count: columns are cut into fixed chunks whose partial sums are added in
// chunk order.
#pragma once

#include <cstdint>

namespace fastagg {

template <typename T>
void int8_blockwise_fold(const int8_t* const* codes, const float* const* scales, int64_t M, int64_t d,
                         int64_t block, const double* coef, const T* init, T* out, double* sq_out,
                         uint8_t* bad_out, double* msq_out);

}  // namespace fastagg
