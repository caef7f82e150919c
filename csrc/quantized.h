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

// Clients of one-byte codes read through a 256-entry table (fp8 e4m3, bitsandbytes' dynamic map), one scale per
// block as above:
//
//   out_j  = init_j + sum_i coef_i * scale_i[j / B] * table[q_ij]
//   sq_i   = sum_b scale_ib^2 * sum_{j in b} table[q_ij]^2          (float64)
//   bad_i  = client i holds a code whose table entry is NaN (out is then garbage)
//
// In every fold sq_out may be null: the squares are not wanted. The table fold then skips them when the table holds
// no NaN (a third less work: the FedAvg family's fold); otherwise they are still summed, to flag bad clients.
template <typename T>
void table_blockwise_fold(const uint8_t* const* codes, const float* table, const float* const* scales, int64_t M,
                          int64_t d, int64_t block, const double* coef, const T* init, T* out, double* sq_out,
                          uint8_t* bad_out, double* msq_out);

// The same for fp8 e4m3 codes, decoded arithmetically (no table); bad_i: a NaN code (0x7F, 0xFF).
template <typename T>
void e4m3_blockwise_fold(const uint8_t* const* codes, const float* const* scales, int64_t M, int64_t d,
                         int64_t block, const double* coef, const T* init, T* out, double* sq_out, uint8_t* bad_out,
                         double* msq_out);

// Sparse clients (k_i indices, strictly increasing in [0, d), and their values) folded into out[0 .. d):
// out = init + sum_i scatter(idx_i, coef_i * val_i), i.e. out[idx_ij] += T(coef_i * val_ij) (the product in float64,
// rounded once), each element's additions in client order; init null: zeros; init == out: in place.
// sq_i = sum_j val_ij^2; msq (when msq_out is not null) = ||out||^2 after the additions, float64.
template <typename T, typename I>
void sparse_fold(const I* const* idx, const float* const* vals, const int64_t* k, int64_t M, const double* coef,
                 const T* init, T* out, int64_t d, double* sq_out, double* msq_out);

// The client side: M rows of d elements (row-major) quantized to int8 blockwise absmax (fastagg/compress/int8.py
// states the rule: scale_b = float32(max |x| / 127) or 1 for an all-zero block, a subnormal scale rounded down
// (or to 0) taken one float32 step up; q = round half to even of x / s,
// or with stochastic floor(x / s + u_j), u_j the (j mod 4)-th word of Philox4x32-10 with counter (j / 4 low and
// high words, round, clients[i]) and key seed, times 2^-32), every operation in float64 as the definition's.
// Rows and blocks are independent: the result never depends on the thread count. Returns the number of blocks
// holding a NaN or Inf (their codes are then meaningless: the caller raises).
template <typename X>
int64_t quantize_int8_rows(const X* x, int64_t M, int64_t d, int64_t block, bool stochastic, uint64_t seed,
                        uint32_t round, const uint32_t* clients, int8_t* codes, float* scales);

// Rows x [M, d] quantized to fp8 e4m3 blockwise: per block, s = float32(absmax (float64) / 448) (1 for a zero block;
// a subnormal scale as quantize_int8_rows),
// v = clamp(double(x) / double(s), +-448) rounded to float32, then to e4m3 (round to nearest even, as torch's
// float32 -> float8_e4m3fn): the definition in fastagg/compress/fp8.py bit for bit. codes [M * d] e4m3 bytes.
// Returns the number of blocks holding a NaN or Inf, as quantize_int8_rows.
template <typename X>
int64_t quantize_fp8_rows(const X* x, int64_t M, int64_t d, int64_t block, uint8_t* codes, float* scales);

}  // namespace fastagg
