// Counter-based Gaussian noise (the definition is in noise.h). 32 Philox counters at a time as SIMD lanes,
// then Box-Muller with float32 polynomials that vectorize (libm's logf/sincosf do not).
#include "noise.h"

// The vector types below never cross a non-inlined call, so the ABI note GCC gives for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <cmath>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace fastagg {
namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // Philox4x32 multipliers
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule (Weyl) increments
constexpr int kLanes = 32;  // Philox blocks per sweep: 128 normals (AVX2: 4 interleaved register groups)

// Eight lanes of float32 / uint32 / int32 (GCC vector extensions: one AVX2 register, two SSE2 ones). libm's
// logf and sincosf do not vectorize, and a plain loop over these polynomials did not either (the selects).
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8u fbits(v8f f) { v8u u; std::memcpy(&u, &f, sizeof u); return u; }
inline v8f bitsf(v8u u) { v8f f; std::memcpy(&f, &u, sizeof f); return f; }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8f select(v8i mask, v8f a, v8f b) {  // mask lanes are all ones (take a) or zero (take b)
  return bitsf((fbits(a) & v8u(mask)) | (fbits(b) & ~v8u(mask)));
}

// Natural log of x > 0 (normal floats): Cephes logf, ~1 ulp.
inline v8f log_poly(v8f x) {
  const v8u b = fbits(x);
  v8f e = __builtin_convertvector(v8i((b >> 23) & 0xffu) - 126, v8f);
  v8f m = bitsf((b & 0x007fffffu) | 0x3f000000u);  // x = m 2^e, m in [0.5, 1)
  const v8i small = m < splat(0.70710678118654752f);
  e = select(small, e - 1.0f, e);
  m = select(small, m + m - 1.0f, m - 1.0f);  // x = (1 + m) 2^e, 1 + m in [sqrt(1/2), sqrt(2))
  const v8f z = m * m;
  v8f y = splat(7.0376836292e-2f);
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return m + y + 0.693359375f * e;
}

// cos(2 pi u), sin(2 pi u) for u in [0, 1]: u = k/4 + t with t in [-1/8, 1/8] (exact), x = 2 pi t in
// [-pi/4, pi/4], Cephes' sinf/cosf polynomials there, then k quarter turns.
inline void sincos_2pi(v8f u, v8f& c, v8f& s) {
  const v8i k = __builtin_convertvector(u * 4.0f + 0.5f, v8i);  // the nearest quadrant (u >= 0)
  const v8f x = (u - __builtin_convertvector(k, v8f) * 0.25f) * 6.28318530717958648f;
  const v8f z = x * x;
  const v8f sp = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * x + x;
  const v8f cp = ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z
                 - 0.5f * z + 1.0f;
  // odd k swaps cos and sin; cos changes sign for k = 1, 2, sin for k = 2, 3
  const v8i odd = (k & 1) != 0;
  c = bitsf(fbits(select(odd, sp, cp)) ^ (v8u((k + 1) & 2) << 30));
  s = bitsf(fbits(select(odd, cp, sp)) ^ (v8u(k & 2) << 30));
}

#ifdef __AVX2__
// (high, low) 32-bit words of m * x for 8 uint32 lanes: vpmuludq multiplies the even lanes; the odd ones are
// shifted down and multiplied too, and the halves are blended back into place (GCC's own vectorization of the
// widening multiply in the loop below took ~4x as long).
inline void mulhilo8(__m256i x, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(x, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}
#endif

// Philox4x32-10 of kLanes consecutive counters (block0 + l, round): c[w][l] is word w of lane l.
inline void philox_lanes(uint64_t block0, uint64_t round, uint64_t seed, uint32_t (&c)[4][kLanes]) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int l = 0; l < kLanes; ++l) {
    const uint64_t b = block0 + static_cast<uint64_t>(l);
    c[0][l] = static_cast<uint32_t>(b);
    c[1][l] = static_cast<uint32_t>(b >> 32);
    c[2][l] = static_cast<uint32_t>(round);
    c[3][l] = static_cast<uint32_t>(round >> 32);
  }
#ifdef __AVX2__
  static_assert(kLanes % 8 == 0, "whole AVX2 registers");
  constexpr int G = kLanes / 8;  // the groups' rounds interleaved: a round's multiply-shift-blend chain is
                                 // latency-bound, G independent chains fill the pipeline
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kM0)), m1 = _mm256_set1_epi32(static_cast<int>(kM1));
  __m256i c0[G], c1[G], c2[G], c3[G];
  for (int g = 0; g < G; ++g) {
    c0[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&c[0][8 * g]));
    c1[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&c[1][8 * g]));
    c2[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&c[2][8 * g]));
    c3[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&c[3][8 * g]));
  }
  for (int r = 0; r < 10; ++r) {
    const __m256i a0 = _mm256_set1_epi32(static_cast<int>(k0)), a1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < G; ++g) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(c0[g], m0, hi0, lo0);
      mulhilo8(c2[g], m1, hi1, lo1);
      c0[g] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[g]), a0);
      c2[g] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[g]), a1);
      c1[g] = lo1;
      c3[g] = lo0;
    }
    k0 += kW0;
    k1 += kW1;
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&c[0][8 * g]), c0[g]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&c[1][8 * g]), c1[g]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&c[2][8 * g]), c2[g]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&c[3][8 * g]), c3[g]);
  }
  return;
#endif
  for (int r = 0; r < 10; ++r) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(kM0) * c[0][l];
      const uint64_t p1 = static_cast<uint64_t>(kM1) * c[2][l];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1][l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3][l] ^ k1;
      c[1][l] = static_cast<uint32_t>(p1);
      c[3][l] = static_cast<uint32_t>(p0);
      c[0][l] = n0;
      c[2][l] = n2;
    }
    k0 += kW0;
    k1 += kW1;
  }
}

// The 4 kLanes normals of Philox blocks block0 .. block0 + kLanes - 1, in coordinate order.
inline void normals_lanes(uint64_t seed, uint64_t round, uint64_t block0, float* out) {
  uint32_t c[4][kLanes];
  philox_lanes(block0, round, seed, c);
  float n[4][kLanes];
  for (int pair = 0; pair < 2; ++pair) {
    for (int l = 0; l < kLanes; l += 8) {
      v8u x0, x1;
      std::memcpy(&x0, &c[2 * pair][l], sizeof x0);
      std::memcpy(&x1, &c[2 * pair + 1][l], sizeof x1);
      const v8f u1 = __builtin_convertvector(x0, v8f) * 0x1p-32f + 0x1p-33f;  // (0, 1]
      const v8f u2 = __builtin_convertvector(x1, v8f) * 0x1p-32f;             // [0, 1]
      v8f r = -2.0f * log_poly(u1);
      for (int q = 0; q < 8; ++q) r[q] = std::sqrt(r[q]);
      v8f cs, sn;
      sincos_2pi(u2, cs, sn);
      const v8f a = r * cs, b = r * sn;
      std::memcpy(&n[2 * pair][l], &a, sizeof a);
      std::memcpy(&n[2 * pair + 1][l], &b, sizeof b);
    }
  }
  for (int l = 0; l < kLanes; ++l)
    for (int w = 0; w < 4; ++w) out[4 * l + w] = n[w][l];
}

}  // namespace

void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0, p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0, n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kW0;
    k1 += kW1;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

void gaussian_fill(uint64_t seed, uint64_t round, int64_t first, int64_t n, float* out) {
  constexpr int64_t kPer = 4 * kLanes;
  float tmp[kPer];
  int64_t j = first;
  const int64_t end = first + n;
  while (j < end) {
    const int64_t chunk0 = j / kPer * kPer;  // the sweep that holds coordinate j
    const int64_t lo = j - chunk0, hi = std::min<int64_t>(kPer, end - chunk0);
    if (lo == 0 && hi == kPer) {
      normals_lanes(seed, round, static_cast<uint64_t>(chunk0 / 4), out + (j - first));
    } else {
      normals_lanes(seed, round, static_cast<uint64_t>(chunk0 / 4), tmp);
      std::copy(tmp + lo, tmp + hi, out + (j - first));
    }
    j = chunk0 + hi;
  }
}

}  // namespace fastagg
