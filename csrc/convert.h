// Element loads and stores for the dtypes fastagg accepts, without torch headers.
// float16 and bfloat16 travel as raw uint16 bits; conversions are exact on load and
// round-to-nearest-even on store, NaN and Inf preserved.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace fastagg {

struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

enum DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_to_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  // Exponent and mantissa moved into float position, then rebias by 2^(127-15);
  // subnormal halves land on float subnormals and scale exactly.
  return bits_to_float(sign | float_to_bits(bits_to_float(em << 13) * 5.192296858534828e33f));
}

inline uint16_t float_to_half(float f) {
  uint32_t x = float_to_bits(f);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t o;
  if (x >= 0x47800000u) {                       // overflow to Inf, or NaN
    o = (x > 0x7f800000u) ? 0x7e00u : 0x7c00u;
  } else if (x < 0x38800000u) {                 // half subnormal or zero
    const uint32_t magic = 126u << 23;          // 0.5f: aligns the mantissa, rounds RNE
    o = float_to_bits(bits_to_float(x) + bits_to_float(magic)) - magic;
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

inline float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// Compute type: float64 for float64 data, float32 for everything else.
template <typename T> struct compute { using type = float; };
template <> struct compute<double> { using type = double; };
template <typename T> using compute_t = typename compute<T>::type;

template <typename C> inline C load(const float* p) { return static_cast<C>(*p); }
template <typename C> inline C load(const double* p) { return static_cast<C>(*p); }
template <typename C> inline C load(const half_t* p) { return static_cast<C>(half_to_float(p->bits)); }
template <typename C> inline C load(const bf16_t* p) { return static_cast<C>(bf16_to_float(p->bits)); }

inline void store(float* p, double v) { *p = static_cast<float>(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(double* p, double v) { *p = v; }
inline void store(half_t* p, float v) { p->bits = float_to_half(v); }
inline void store(bf16_t* p, float v) { p->bits = float_to_bf16(v); }

// Guarded stores: a new value is written only when it is finite in the dtype it is stored in (select, so loops
// stay vectorized); otherwise the old value stays.
template <typename C> inline bool finite_c(C v) { return v - v == C(0); }
template <typename P> inline P pick(bool take, P a, P b) { return take ? a : b; }
inline half_t pick(bool take, half_t a, half_t b) { return half_t{take ? a.bits : b.bits}; }
inline bf16_t pick(bool take, bf16_t a, bf16_t b) { return bf16_t{take ? a.bits : b.bits}; }
template <typename P, typename C> inline P rounded(C v) { P p; store(&p, v); return p; }
// v stays finite once stored as P. When P is the compute type itself no rounding happens, and the test is one
// compare that vectorizes (the general path takes the stored value's address and keeps the loop scalar).
template <typename P, typename C> inline bool stays_finite(C v) {
  if constexpr (std::is_same_v<P, C>) return finite_c(v);
  else { const P p = rounded<P>(v); return finite_c(load<C>(&p)); }
}

// Calls f(T{}) with the C++ type of a dtype code.
template <typename F> void dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
    case kFloat16: f(half_t{}); break;
    case kBFloat16: f(bf16_t{}); break;
    case kFloat32: f(float{}); break;
    case kFloat64: f(double{}); break;
    default: throw std::invalid_argument("fastagg._C: unknown dtype code");
  }
}

}  // namespace fastagg
