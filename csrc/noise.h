// Counter-based Gaussian noise for differential privacy (fastagg.privacy): the noise of coordinate j in round r is
// a pure function of (seed, r, j), so a round's noise is reproducible from its seed, independent of the thread
// count, of the block partition and of the update's layout (j is the flat coordinate).
//
//   (x0, x1, x2, x3) = Philox4x32-10(counter = (j/4 low 32 bits, j/4 high 32 bits, r low, r high),
//                                    key = (seed low 32 bits, seed high 32 bits))     Salmon et al., SC'11
//   u1 = float(x0) * 2^-32 + 2^-33,  u2 = float(x1) * 2^-32            (float32; u1 in (0, 1], u2 in [0, 1])
//   n0 = sqrt(-2 ln u1) cos(2 pi u2),  n1 = sqrt(-2 ln u1) sin(2 pi u2)   (Box-Muller; x2, x3 give n2, n3)
//   coordinate j takes n_(j mod 4)
//
// The Philox words are bit-identical on every backend (tested against Random123's known answers); the float32
// transform here uses its own polynomials (Cephes' logf, sinf, cosf on [-pi/4, pi/4]) so that it vectorizes, and
// agrees with the float64 transform of the reference backend to ~1e-6 (tested). Not a cryptographically secure
// generator (neither is any peer's): fastagg.privacy takes a noise source of the caller's for that.
#pragma once
#include <cstdint>

namespace fastagg {

// Fills out[0, n) with the N(0, 1) noise of flat coordinates first, ..., first + n - 1.
void gaussian_fill(uint64_t seed, uint64_t round, int64_t first, int64_t n, float* out);

// Philox4x32-10 of one counter (for the known-answer test and the bindings).
void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

}  // namespace fastagg
