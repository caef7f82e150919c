// int8 blockwise absmax clients folded into a sum (quantized.h). Every pointer here was checked by the binding.
#include "quantized.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "noise.h"
#include "segments.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastagg {

namespace {
constexpr int64_t kChunk = int64_t(1) << 16;  // columns per chunk (its partial sums are added in chunk order)
constexpr int64_t kTile = 2048;               // columns kept in L1 while every client is added
constexpr int64_t kStreamBytes = int64_t(32) << 20;  // an output this large (a server L3) bypasses the caches
}  // namespace

// The portable tiles' walk over a tile of n columns from lo that may span blocks, block by block, client by client
// over the tile kept in L1: visit(r, i, q, len, c, a) for client i's part of block r (counted from lo's block):
// its len codes q, its coefficient c = cs[r * ld + i] and the accumulator slice a under them.
template <typename Code, typename T, typename Visit>
void block_segments(const Code* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld, int64_t block,
                    const T* cs, T* acc, const Visit& visit) {
  const int64_t b0 = lo / block;
  for (int64_t s = lo; s < lo + n;) {
    const int64_t e = std::min(lo + n, (s / block + 1) * block);
    const int64_t r = s / block - b0;
    for (int64_t i = 0; i < M; ++i) visit(r, i, codes[i] + s, e - s, cs[r * ld + i], acc + (s - lo));
    s = e;
  }
}

// One tile of n columns from lo, which may span blocks (r = the block's index in the tile, from lo / block): acc[t]
// (+)= sum_i cs[r * ld + i] * q_i[t]; qq[r * ld + i] += the sum of q_i^2 over that block's columns; lowest[i] =
// min(lowest[i], min_t q_i[t]).
template <typename T>
void fold_tile(const int8_t* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld, int64_t block,
               const T* cs, T* acc, int64_t* qq, int32_t* lowest) {
  block_segments(codes, lo, n, M, ld, block, cs, acc,
                 [&](int64_t r, int64_t i, const int8_t* q, int64_t len, T c, T* a) {
    // int32 sums: a tile holds at most kTile codes of |q| <= 128, so sum q^2 <= 2048 * 16384 < 2^31
    int32_t sq = 0;
    int32_t low = 0;
#pragma omp simd reduction(+ : sq) reduction(min : low)
    for (int64_t t = 0; t < len; ++t) {
      const int32_t v = q[t];
      a[t] += c * static_cast<T>(v);
      sq += v * v;
      low = v < low ? v : low;
    }
    qq[r * ld + i] += sq;
    lowest[i] = std::min(lowest[i], low);
  });
}

#ifdef __AVX2__
namespace {
inline int32_t hsum_epi32(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

inline int32_t hmin_epi8(__m256i v) {
  __m128i m16 = _mm_min_epi8(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m16 = _mm_min_epi8(m16, _mm_srli_si128(m16, 8));
  m16 = _mm_min_epi8(m16, _mm_srli_si128(m16, 4));
  m16 = _mm_min_epi8(m16, _mm_srli_si128(m16, 2));
  m16 = _mm_min_epi8(m16, _mm_srli_si128(m16, 1));
  return static_cast<int8_t>(_mm_cvtsi128_si32(m16) & 0xFF);
}

inline __m256 codes_as_floats(const int8_t* p) {  // 8 codes sign-extended straight from memory (one vpmovsxbd)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The register-blocked tile the one-byte formats share on AVX2 (float32 sums): 64 columns at a time with their sums
// in eight registers while every client is added (the codes read once from memory, the sums never leave the
// registers). `visit(i, src, c, a)` adds client i's 64 codes at src, times c, into a[0 .. 8) and keeps its own
// per-block state; `hand_over(r)` moves that state into the slots of the tile's block r. A tile may span blocks
// when they are whole multiples of 64 columns (the sweep sees to it), so a block change falls between two groups
// of 64, and `tail(r, whole)` adds the last n % 64 columns, which lie in one block r.
template <typename Code, typename Visit, typename HandOver, typename Tail>
void register_blocked_tile(const Code* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld, int64_t block,
                           const float* cs, float* acc, const Visit& visit, const HandOver& hand_over,
                           const Tail& tail) {
  const int64_t b0 = lo / block;
  int64_t r_now = 0;
  const int64_t whole = n - n % 64;
  for (int64_t g = 0; g < whole; g += 64) {
    const int64_t r = (lo + g) / block - b0;
    if (r != r_now) {
      hand_over(r_now);
      r_now = r;
    }
    const float* crow = cs + r * ld;
    __m256 a[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm256_loadu_ps(acc + g + 8 * k);
    for (int64_t i = 0; i < M; ++i) {
      const Code* src = codes[i] + lo + g;
      // the next lines prefetched: with M streams read in turn, the hardware prefetchers alone left it waiting
      _mm_prefetch(reinterpret_cast<const char*>(src) + 512, _MM_HINT_T0);
      visit(i, src, _mm256_set1_ps(crow[i]), a);
    }
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(acc + g + 8 * k, a[k]);
  }
  hand_over(r_now);
  if (whole < n) tail((lo + whole) / block - b0, whole);
}

// The last n < 64 columns of a register-blocked int8 tile, from lo, in one block (coefficients cs[i], squares into
// qq[i]): shared by the AVX2 and AVX-512 tiles, so both give the same bits.
inline void int8_tail(const int8_t* const* codes, int64_t lo, int64_t n, int64_t M, const float* cs, float* acc,
                      int64_t* qq, int32_t* lowest) {
  for (int64_t i = 0; i < M; ++i) {
    const int8_t* q = codes[i] + lo;
    int32_t sq = 0, low = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int32_t v = q[t];
      acc[t] += cs[i] * static_cast<float>(v);
      sq += v * v;
      low = v < low ? v : low;
    }
    qq[i] += sq;
    lowest[i] = std::min(lowest[i], low);
  }
}
}  // namespace

// float32 on AVX2, register-blocked (register_blocked_tile): squares of 32 codes by |q| * |q| (vpmaddubsw) and
// pairs of those (vpmaddwd), exact for every valid code (|q| <= 127: a -128 flags the client anyway), handed over
// per block; the minimum by vpminsb.
template <>
void fold_tile<float>(const int8_t* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld, int64_t block,
                      const float* cs, float* acc, int64_t* qq, int32_t* lowest) {
  constexpr int64_t kMaxM = 64;
  if (M > kMaxM) {  // (the per-client vector sums below live on the stack)
    for (int64_t i0 = 0; i0 < M; i0 += kMaxM)
      fold_tile<float>(codes + i0, lo, n, std::min(kMaxM, M - i0), ld, block, cs + i0, acc, qq + i0, lowest + i0);
    return;
  }
  __m256i sqv[kMaxM], lowv[kMaxM];
  for (int64_t i = 0; i < M; ++i) {
    sqv[i] = _mm256_setzero_si256();
    lowv[i] = _mm256_setzero_si256();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  register_blocked_tile(
      codes, lo, n, M, ld, block, cs, acc,
      [&](int64_t i, const int8_t* src, __m256 c, __m256* a) {
        for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(c, codes_as_floats(src + 8 * k), a[k]);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
        const __m256i av = _mm256_abs_epi8(v), au = _mm256_abs_epi8(u);
        const __m256i sq = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(av, av), ones),
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(au, au), ones));
        sqv[i] = _mm256_add_epi32(sqv[i], sq);
        lowv[i] = _mm256_min_epi8(lowv[i], _mm256_min_epi8(v, u));
      },
      [&](int64_t r) {
        for (int64_t i = 0; i < M; ++i) {
          qq[r * ld + i] += hsum_epi32(sqv[i]);
          sqv[i] = _mm256_setzero_si256();
        }
      },
      [&](int64_t r, int64_t whole) { int8_tail(codes, lo + whole, n - whole, M, cs + r * ld, acc + whole, qq + r * ld, lowest); });
  for (int64_t i = 0; i < M; ++i) lowest[i] = std::min(lowest[i], hmin_epi8(lowv[i]));
}
#endif

// out[0 .. n) = acc[0 .. n), returning sum_t acc[t]^2 in float64 over eight interleaved partial sums (one running
// sum was a dependency chain of n adds: as slow as the fold itself at block 256).
template <typename T>
double store_and_square(const T* acc, T* out, int64_t n, bool /*stream*/) {
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t whole = n - n % 8;
  for (int64_t t = 0; t < whole; t += 8) {
    for (int k = 0; k < 8; ++k) {
      out[t + k] = acc[t + k];
      part[k] += static_cast<double>(acc[t + k]) * static_cast<double>(acc[t + k]);
    }
  }
  for (int64_t t = whole; t < n; ++t) {
    out[t] = acc[t];
    part[t - whole] += static_cast<double>(acc[t]) * static_cast<double>(acc[t]);
  }
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

#ifdef __AVX2__
// float32 on AVX2, with `stream`: out written by non-temporal stores where 32-byte aligned (an output much larger
// than the caches is not read first for ownership: a third less memory traffic for the write). The caller fences.
template <>
double store_and_square<float>(const float* acc, float* out, int64_t n, bool stream) {
  __m256d p0 = _mm256_setzero_pd(), p1 = _mm256_setzero_pd(), p2 = _mm256_setzero_pd(), p3 = _mm256_setzero_pd();
  const bool nt = stream && reinterpret_cast<uintptr_t>(out) % 32 == 0;
  const int64_t whole = n - n % 16;
  for (int64_t t = 0; t < whole; t += 16) {
    const __m256 a = _mm256_loadu_ps(acc + t), b = _mm256_loadu_ps(acc + t + 8);
    if (nt) {
      _mm256_stream_ps(out + t, a);
      _mm256_stream_ps(out + t + 8, b);
    } else {
      _mm256_storeu_ps(out + t, a);
      _mm256_storeu_ps(out + t + 8, b);
    }
    const __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a)), a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    const __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(b)), b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
    p0 = _mm256_fmadd_pd(a0, a0, p0);
    p1 = _mm256_fmadd_pd(a1, a1, p1);
    p2 = _mm256_fmadd_pd(b0, b0, p2);
    p3 = _mm256_fmadd_pd(b1, b1, p3);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(p0, p1), _mm256_add_pd(p2, p3)));
  double s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (int64_t t = whole; t < n; ++t) {
    out[t] = acc[t];
    s += static_cast<double>(acc[t]) * static_cast<double>(acc[t]);
  }
  return s;
}
#endif

// The sweep every blockwise format shares: columns cut into fixed chunks (one per thread at a time), each chunk into
// tiles. `tile(lo, n, cs, acc, inner, bad)` adds sum_i cs[r * M + i] * v_i[lo + t] into acc[0 .. n) (r: the block
// of column lo + t, counted from lo's) and, per block and client, the sum of v^2 into inner[r * M + i] (float64),
// and whether a client met an invalid code into bad[i]. Tiles never cross a block boundary unless `span_blocks` and
// the blocks are whole multiples of 64 columns (then a tile of kTile columns may hold many small blocks, and the
// per-tile work is paid once per kTile columns, not once per block).
template <typename T, typename Tile>
void blockwise_sweep(const float* const* scales, int64_t M, int64_t d, int64_t block, const double* coef,
                     const T* init, T* out, double* sq_out, uint8_t* bad_out, double* msq_out, int64_t code_bytes,
                     bool span_blocks, const Tile& tile) {
  const bool spans = span_blocks && block % 64 == 0;
  const int64_t max_blocks = spans ? kTile / 64 + 1 : 1;
  const bool stream = d * int64_t(sizeof(T)) >= kStreamBytes;
  const int64_t chunks = (d + kChunk - 1) / kChunk;
  std::vector<double> part_sq(static_cast<size_t>(chunks * M), 0.0), part_msq(static_cast<size_t>(chunks), 0.0);
  std::vector<uint8_t> part_bad(static_cast<size_t>(chunks * M), 0);
#pragma omp parallel for schedule(static) num_threads(threads_for(d * (M * code_bytes + 2 * int64_t(sizeof(T)))))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t c_lo = c * kChunk, c_hi = std::min(d, c_lo + kChunk);
    double* psq = part_sq.data() + c * M;
    uint8_t* pbad = part_bad.data() + c * M;
    double msq = 0.0;
    alignas(32) T acc[kTile];
    std::vector<T> cs(static_cast<size_t>(max_blocks * M));
    std::vector<double> inner(static_cast<size_t>(max_blocks * M));
    for (int64_t lo = c_lo; lo < c_hi;) {
      const int64_t b0 = lo / block;
      const int64_t hi = spans ? std::min(c_hi, lo + kTile) : std::min({c_hi, lo + kTile, (b0 + 1) * block});
      const int64_t n = hi - lo, nb = (hi - 1) / block - b0 + 1;
      if (init != nullptr) {
        for (int64_t t = 0; t < n; ++t) acc[t] = init[lo + t];
      } else {
        for (int64_t t = 0; t < n; ++t) acc[t] = T(0);
      }
      for (int64_t r = 0; r < nb; ++r) {
        for (int64_t i = 0; i < M; ++i) {
          cs[r * M + i] = static_cast<T>(coef[i] * static_cast<double>(scales[i][b0 + r]));
          inner[r * M + i] = 0.0;
        }
      }
      tile(lo, n, cs.data(), acc, inner.data(), pbad);
      if (sq_out != nullptr) {
        for (int64_t r = 0; r < nb; ++r) {
          for (int64_t i = 0; i < M; ++i) {
            const double s = static_cast<double>(scales[i][b0 + r]);
            psq[i] += s * s * inner[r * M + i];
          }
        }
      }
      msq += store_and_square(acc, out + lo, n, stream);
      lo = hi;
    }
#ifdef __AVX2__
    if (stream) _mm_sfence();  // this thread's non-temporal stores visible before the region's barrier
#endif
    part_msq[c] = msq;
  }
  double msq = 0.0;
  for (int64_t i = 0; i < M; ++i) {
    if (sq_out != nullptr) sq_out[i] = 0.0;
    bad_out[i] = 0;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    msq += part_msq[c];
    for (int64_t i = 0; i < M; ++i) {
      if (sq_out != nullptr) sq_out[i] += part_sq[c * M + i];
      bad_out[i] |= part_bad[c * M + i];
    }
  }
  *msq_out = msq;
}

#if defined(__AVX2__) && defined(__GNUC__) && defined(__x86_64__)
#define FASTAGG_AVX512 1
namespace {
// AVX-512 paths are chosen at run time where the CPU has them; FASTAGG_NO_AVX512=1 keeps the AVX2 ones.
bool avx512_allowed() {
  const char* off = std::getenv("FASTAGG_NO_AVX512");
  return !(off != nullptr && off[0] != '\0' && std::strcmp(off, "0") != 0);
}

// The AVX-512 tiles (int8, fp8) need F, BW and VNNI: Ice Lake, Cascade Lake, Sapphire Rapids, Zen 4 and later.
bool avx512_tiles_usable() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return cpu && avx512_allowed();
}

// One target for the walk and the visitors it inlines (GCC inlines only between equal targets, and a lambda does
// not take its enclosing function's target: the visitors are structs whose members carry it).
#define FASTAGG_AVX512_TILE __attribute__((target("avx512f,avx512bw,avx512vnni")))

// register_blocked_tile on AVX-512: 64 columns' float32 sums in four zmm registers while every client is added.
// v.client(i, src, c, a) adds client i's 64 codes at src, times c, into a[0 .. 4); v.hand_over(r) moves its per-block
// state into the slots of the tile's block r; v.tail(r, whole) adds the last n % 64 columns (one block r).
template <typename Code, typename Visit>
FASTAGG_AVX512_TILE void register_blocked_tile512(const Code* const* codes, int64_t lo, int64_t n, int64_t M,
                                                  int64_t ld, int64_t block, const float* cs, float* acc, Visit& v) {
  const int64_t b0 = lo / block;
  int64_t r_now = 0;
  const int64_t whole = n - n % 64;
  for (int64_t g = 0; g < whole; g += 64) {
    const int64_t r = (lo + g) / block - b0;
    if (r != r_now) {
      v.hand_over(r_now);
      r_now = r;
    }
    const float* crow = cs + r * ld;
    __m512 a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm512_loadu_ps(acc + g + 16 * k);
    for (int64_t i = 0; i < M; ++i) {
      const Code* src = codes[i] + lo + g;
      _mm_prefetch(reinterpret_cast<const char*>(src) + 512, _MM_HINT_T0);
      v.client(i, src, _mm512_set1_ps(crow[i]), a);
    }
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc + g + 16 * k, a[k]);
  }
  v.hand_over(r_now);
  if (whole < n) v.tail((lo + whole) / block - b0, whole);
}

// fold_tile<float> on AVX-512: a client's 64 codes as four widened loads, its squares by one vpdpbusd of |q| with
// itself (the same products as vpmaddubsw + vpmaddwd: exact for |q| <= 127; a -128 flags the client anyway). Each
// column gets the same float32 FMAs in the same client order as on AVX2, so both give the same bits.
struct Int8Tile512 {
  static constexpr int64_t kMaxM = 64;
  const int8_t* const* codes;
  int64_t lo, n, M, ld;
  const float* cs;
  float* acc;
  int64_t* qq;
  int32_t* lowest;
  __m512i* sq;   // [M] per client: the squares of its codes in this block
  __m512i* low;  // [M] per client: the minimum code so far

  FASTAGG_AVX512_TILE void client(int64_t i, const int8_t* src, __m512 c, __m512* a) {
    for (int k = 0; k < 4; ++k) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * k));
      a[k] = _mm512_fmadd_ps(c, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), a[k]);
    }
    const __m512i v = _mm512_loadu_si512(src);
    const __m512i av = _mm512_abs_epi8(v);
    sq[i] = _mm512_dpbusd_epi32(sq[i], av, av);
    low[i] = _mm512_min_epi8(low[i], v);
  }
  FASTAGG_AVX512_TILE void hand_over(int64_t r) {
    for (int64_t i = 0; i < M; ++i) {
      qq[r * ld + i] += _mm512_reduce_add_epi32(sq[i]);
      sq[i] = _mm512_setzero_si512();
    }
  }
  void tail(int64_t r, int64_t whole) {
    int8_tail(codes, lo + whole, n - whole, M, cs + r * ld, acc + whole, qq + r * ld, lowest);
  }
};

FASTAGG_AVX512_TILE void fold_tile_avx512(const int8_t* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld,
                                          int64_t block, const float* cs, float* acc, int64_t* qq, int32_t* lowest) {
  constexpr int64_t kMaxM = Int8Tile512::kMaxM;
  if (M > kMaxM) {
    for (int64_t i0 = 0; i0 < M; i0 += kMaxM)
      fold_tile_avx512(codes + i0, lo, n, std::min(kMaxM, M - i0), ld, block, cs + i0, acc, qq + i0, lowest + i0);
    return;
  }
  __m512i sq[kMaxM], low[kMaxM];
  for (int64_t i = 0; i < M; ++i) {
    sq[i] = _mm512_setzero_si512();
    low[i] = _mm512_setzero_si512();
  }
  Int8Tile512 v{codes, lo, n, M, ld, cs, acc, qq, lowest, sq, low};
  register_blocked_tile512(codes, lo, n, M, ld, block, cs, acc, v);
  for (int64_t i = 0; i < M; ++i) {
    const __m256i m = _mm256_min_epi8(_mm512_castsi512_si256(low[i]), _mm512_extracti64x4_epi64(low[i], 1));
    lowest[i] = std::min(lowest[i], hmin_epi8(m));
  }
}
}  // namespace
#endif

template <typename T>
void int8_blockwise_fold(const int8_t* const* codes, const float* const* scales, int64_t M, int64_t d,
                         int64_t block, const double* coef, const T* init, T* out, double* sq_out,
                         uint8_t* bad_out, double* msq_out) {
  auto fold = fold_tile<T>;
#ifdef FASTAGG_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (avx512_tiles_usable()) fold = fold_tile_avx512;
  }
#endif
  blockwise_sweep<T>(scales, M, d, block, coef, init, out, sq_out, bad_out, msq_out, 1, true,
                     [&](int64_t lo, int64_t n, const T* cs, T* acc, double* inner, uint8_t* bad) {
                       thread_local std::vector<int64_t> qq;
                       thread_local std::vector<int32_t> lowest;
                       const int64_t nb = (lo + n - 1) / block - lo / block + 1;
                       qq.assign(static_cast<size_t>(nb * M), 0);
                       lowest.assign(static_cast<size_t>(M), 0);
                       fold(codes, lo, n, M, M, block, cs, acc, qq.data(), lowest.data());
                       for (int64_t j = 0; j < nb * M; ++j) inner[j] = static_cast<double>(qq[j]);  // exact: < 2^53
                       for (int64_t i = 0; i < M; ++i) bad[i] |= lowest[i] < -127;
                     });
}

namespace {
// An e4m3 byte's value without a table (so the loop vectorizes, no gathers): the magnitude's 7 bits shifted into a
// float32's exponent and mantissa and rebiased (2^(e - 7) * 1.mmm), or for e = 0 the subnormal mmm * 2^-9; the
// sign bit moved to bit 31. The two NaN codes (0x7F, 0xFF) decode as 480 here: the callers flag them apart.
inline float e4m3_value(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  uint32_t normal = (mag << 20) + (120u << 23);
  float nf;
  std::memcpy(&nf, &normal, 4);
  float v = mag >= 8u ? nf : static_cast<float>(mag) * 0x1p-9f;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits |= sign;
  std::memcpy(&v, &bits, 4);
  return v;
}
}  // namespace

// One tile of n columns, client by client: acc[t] += cs[i] * table[q_i[t]]; inner[i] = sum_t table[q_i[t]]^2
// (float64; NaN once a code maps to NaN: the client is flagged, out is garbage). Squares = false: the fold alone,
// inner and bad untouched (only for a table with no NaN entry: no code can then be invalid). Portable; float32 on
// AVX2 below.
template <bool Squares, typename T>
void table_tile(const uint8_t* const* codes, const float* table, int64_t lo, int64_t n, int64_t M, const T* cs,
                T* acc, double* inner, uint8_t* bad) {
  for (int64_t i = 0; i < M; ++i) {
    const uint8_t* q = codes[i] + lo;
    const T c = cs[i];
    double s = 0.0;
    for (int64_t t = 0; t < n; ++t) {
      const float v = table[q[t]];
      acc[t] += c * static_cast<T>(v);
      if constexpr (Squares) s += static_cast<double>(v) * static_cast<double>(v);
    }
    if constexpr (Squares) {
      inner[i] = s;
      bad[i] |= !(s == s);
    }
  }
}

#ifdef __AVX2__
// 8 codes at a time: widened to int32 and gathered from the table (256 floats: L1-resident).
template <bool Squares>
void table_tile_avx2(const uint8_t* const* codes, const float* table, int64_t lo, int64_t n, int64_t M,
                     const float* cs, float* acc, double* inner, uint8_t* bad) {
  const int64_t whole = n - n % 8;
  for (int64_t i = 0; i < M; ++i) {
    const uint8_t* q = codes[i] + lo;
    const __m256 c = _mm256_set1_ps(cs[i]);
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    for (int64_t t = 0; t < whole; t += 8) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + t)));
      const __m256 v = _mm256_i32gather_ps(table, b, 4);
      _mm256_storeu_ps(acc + t, _mm256_fmadd_ps(c, v, _mm256_loadu_ps(acc + t)));
      if constexpr (Squares) {
        const __m256d lo4 = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        const __m256d hi4 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        s0 = _mm256_fmadd_pd(lo4, lo4, s0);
        s1 = _mm256_fmadd_pd(hi4, hi4, s1);
      }
    }
    if constexpr (!Squares) {
      for (int64_t t = whole; t < n; ++t) acc[t] += cs[i] * table[q[t]];
      continue;
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
    double s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (int64_t t = whole; t < n; ++t) {
      const float v = table[q[t]];
      acc[t] += cs[i] * v;
      s += static_cast<double>(v) * static_cast<double>(v);
    }
    inner[i] = s;
    bad[i] |= !(s == s);
  }
}
#endif

#if defined(__AVX2__) && defined(__GNUC__) && defined(__x86_64__)
#define FASTAGG_VBMI 1
namespace {
// AVX-512 VBMI (Ice Lake, Zen 4 and later), chosen at run time: FASTAGG_NO_AVX512=1 keeps the AVX2 gathers.
bool vbmi_usable() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vbmi");
  return cpu && avx512_allowed();
}

// The 256-entry float table as four byte planes (plane b: byte b of every entry), for vpermi2b lookups.
void table_planes(const float* table, uint8_t* planes) {
  for (int k = 0; k < 256; ++k) {
    uint32_t bits;
    std::memcpy(&bits, table + k, 4);
    for (int b = 0; b < 4; ++b) planes[b * 256 + k] = static_cast<uint8_t>(bits >> (8 * b));
  }
}

// Whether the book is sign-symmetric about code 127: table[c] and table[254 - c] differ in the sign bit alone
// (c < 127). bitsandbytes' dynamic map is (its codes 0..126 negative, 127 zero, 128..254 their negations, 255 is
// 1.0); so is any book built as sign * magnitude. Such a book is one 128-entry half plus a sign, and the lookup
// needs half the permutes.
bool table_sign_symmetric(const float* table) {
  for (int c = 0; c < 127; ++c) {
    uint32_t a, b;
    std::memcpy(&a, table + c, 4);
    std::memcpy(&b, table + 254 - c, 4);
    if ((a ^ b) != 0x80000000u) return false;
  }
  return true;
}

// Each client's float64 squares (8 lanes) added into inner[i] and reset.
__attribute__((target("avx512f")))
void hand_over_pd8(__m512d* sq, int64_t M, double* inner) {
  for (int64_t i = 0; i < M; ++i) {
    alignas(64) double lanes[8];
    _mm512_store_pd(lanes, sq[i]);
    inner[i] += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    sq[i] = _mm512_setzero_pd();
  }
}

// 128-bit lanes of four registers transposed: z'[j] lane l = z[l] lane j (its own inverse).
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
inline void vbmi_transpose(__m512* z) {
  const __m512 t0 = _mm512_shuffle_f32x4(z[0], z[1], 0x44), t1 = _mm512_shuffle_f32x4(z[0], z[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(z[2], z[3], 0x44), t3 = _mm512_shuffle_f32x4(z[2], z[3], 0xEE);
  z[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  z[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  z[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  z[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

// The table fold of fold_tile's shape (64 columns' sums in registers while every client is added; tiles may span
// blocks of whole multiples of 64 columns) with lookups by byte permutes instead of gathers: for 64 codes, each byte
// plane is two vpermi2b over its 128-entry halves blended by the code's top bit, and the four planes interleave
// into floats in the order {0-3, 16-19, 32-35, 48-51}, {4-7, ...}, ...: the sums are held in that order (a 4 x 4
// transpose of 128-bit lanes on the way in and out). Symmetric (a book passing table_sign_symmetric): one vpermi2b
// per plane over entries 0..127, at c for c < 128 and at 254 - c (mod 128) above, the code's top bit xor-ed into
// the sign, and code 255 given its own entry by a masked move. Squares in float64 (exact per element); a NaN entry
// makes the client's sum of squares NaN, which flags it.
template <bool Squares, bool Symmetric>
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
void table_tile_vbmi(const uint8_t* const* codes, const uint8_t* planes, const float* table, int64_t lo, int64_t n,
                     int64_t M, int64_t ld, int64_t block, const float* cs, float* acc, double* inner, uint8_t* bad) {
  constexpr int64_t kMaxM = 32;
  if (M > kMaxM) {
    for (int64_t i0 = 0; i0 < M; i0 += kMaxM)
      table_tile_vbmi<Squares, Symmetric>(codes + i0, planes, table, lo, n, std::min(kMaxM, M - i0), ld, block,
                                          cs + i0, acc, inner + i0, bad + i0);
    return;
  }
  __m512i tab[4][4];
  for (int b = 0; b < 4; ++b)
    for (int j = 0; j < (Symmetric ? 2 : 4); ++j) tab[b][j] = _mm512_loadu_si512(planes + b * 256 + 64 * j);
  __m512i last[4];  // code 255's bytes, plane by plane (Symmetric)
  for (int b = 0; b < 4; ++b) last[b] = _mm512_set1_epi8(static_cast<char>(planes[b * 256 + 255]));
  const __m512i k254 = _mm512_set1_epi8(static_cast<char>(254)), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512d sq[kMaxM];
  for (int64_t i = 0; i < M; ++i) sq[i] = _mm512_setzero_pd();
  const int64_t b0 = lo / block;
  int64_t r_now = 0;
  const int64_t whole = n - n % 64;
  for (int64_t g = 0; g < whole; g += 64) {
    const int64_t r = (lo + g) / block - b0;
    if (Squares && r != r_now) {
      hand_over_pd8(sq, M, inner + r_now * ld);
      r_now = r;
    }
    const float* crow = cs + r * ld;
    __m512 a[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm512_loadu_ps(acc + g + 16 * j);
    vbmi_transpose(a);
    for (int64_t i = 0; i < M; ++i) {
      const uint8_t* src = codes[i] + lo + g;
      _mm_prefetch(reinterpret_cast<const char*>(src) + 512, _MM_HINT_T0);
      const __m512i idx = _mm512_loadu_si512(src);
      const __mmask64 top = _mm512_movepi8_mask(idx);
      __m512i p[4];
      if constexpr (Symmetric) {
        const __m512i half = _mm512_mask_sub_epi8(idx, top, k254, idx);
        for (int b = 0; b < 4; ++b) p[b] = _mm512_permutex2var_epi8(tab[b][0], half, tab[b][1]);
        p[3] = _mm512_ternarylogic_epi32(p[3], idx, sign, 0x78);  // p3 ^ (idx & 0x80)
        const __mmask64 ff = _mm512_cmpeq_epi8_mask(idx, _mm512_set1_epi8(-1));
        for (int b = 0; b < 4; ++b) p[b] = _mm512_mask_mov_epi8(p[b], ff, last[b]);
      } else {
        for (int b = 0; b < 4; ++b)
          p[b] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(tab[b][0], idx, tab[b][1]),
                                        _mm512_permutex2var_epi8(tab[b][2], idx, tab[b][3]));
      }
      const __m512i lo01 = _mm512_unpacklo_epi8(p[0], p[1]), hi01 = _mm512_unpackhi_epi8(p[0], p[1]);
      const __m512i lo23 = _mm512_unpacklo_epi8(p[2], p[3]), hi23 = _mm512_unpackhi_epi8(p[2], p[3]);
      const __m512 f[4] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)),
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)),
                           _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)),
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23))};
      const __m512 c = _mm512_set1_ps(crow[i]);
      if constexpr (!Squares) {
        for (int j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(c, f[j], a[j]);
        continue;
      }
      __m512d s = sq[i];
      for (int j = 0; j < 4; ++j) {
        a[j] = _mm512_fmadd_ps(c, f[j], a[j]);
        const __m512d v0 = _mm512_cvtps_pd(_mm512_castps512_ps256(f[j]));
        const __m512d v1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f[j]), 1)));
        s = _mm512_fmadd_pd(v0, v0, _mm512_fmadd_pd(v1, v1, s));
      }
      sq[i] = s;
    }
    vbmi_transpose(a);
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + g + 16 * j, a[j]);
  }
  if constexpr (Squares) hand_over_pd8(sq, M, inner + r_now * ld);
  if (whole < n) {  // the tail lies in one block (see fold_tile<float>)
    const int64_t r = (lo + whole) / block - b0;
    for (int64_t i = 0; i < M; ++i) {
      const uint8_t* q = codes[i] + lo + whole;
      const float c = cs[r * ld + i];
      double s2 = 0.0;
      for (int64_t t = 0; t < n - whole; ++t) {
        const float v = table[q[t]];
        acc[whole + t] += c * v;
        s2 += static_cast<double>(v) * static_cast<double>(v);
      }
      if constexpr (Squares) inner[r * ld + i] += s2;
    }
  }
  if constexpr (!Squares) return;
  const int64_t nb = (lo + n - 1) / block - b0 + 1;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t r = 0; r < nb; ++r) bad[i] |= !(inner[r * ld + i] == inner[r * ld + i]);
}
}  // namespace
#endif

namespace {
// Whether any of the 256 entries is NaN (then a code can be invalid, and only the squares' NaN finds which client).
bool table_holds_nan(const float* table) {
  for (int k = 0; k < 256; ++k)
    if (table[k] != table[k]) return true;
  return false;
}

template <bool Squares, typename T>
void table_fold(const uint8_t* const* codes, const float* table, const float* const* scales, int64_t M, int64_t d,
                int64_t block, const double* coef, const T* init, T* out, double* sq_out, uint8_t* bad_out,
                double* msq_out) {
#ifdef FASTAGG_VBMI
  if constexpr (std::is_same_v<T, float>) {
    if (vbmi_usable()) {
      alignas(64) uint8_t planes[1024];
      table_planes(table, planes);
      const bool symmetric = table_sign_symmetric(table);
      blockwise_sweep<T>(scales, M, d, block, coef, init, out, sq_out, bad_out, msq_out, 1, true,
                         [&](int64_t lo, int64_t n, const T* cs, T* acc, double* inner, uint8_t* bad) {
                           if (symmetric)
                             table_tile_vbmi<Squares, true>(codes, planes, table, lo, n, M, M, block, cs, acc, inner,
                                                            bad);
                           else
                             table_tile_vbmi<Squares, false>(codes, planes, table, lo, n, M, M, block, cs, acc,
                                                             inner, bad);
                         });
      return;
    }
  }
#endif
  blockwise_sweep<T>(scales, M, d, block, coef, init, out, sq_out, bad_out, msq_out, 1, false,
                     [&](int64_t lo, int64_t n, const T* cs, T* acc, double* inner, uint8_t* bad) {
#ifdef __AVX2__
                       if constexpr (std::is_same_v<T, float>) {
                         table_tile_avx2<Squares>(codes, table, lo, n, M, cs, acc, inner, bad);
                         return;
                       }
#endif
                       table_tile<Squares, T>(codes, table, lo, n, M, cs, acc, inner, bad);
                     });
}
}  // namespace

// sq_out null: the clients' squares are skipped where no code can be invalid (a table without NaN).
template <typename T>
void table_blockwise_fold(const uint8_t* const* codes, const float* table, const float* const* scales, int64_t M,
                          int64_t d, int64_t block, const double* coef, const T* init, T* out, double* sq_out,
                          uint8_t* bad_out, double* msq_out) {
  if (sq_out == nullptr && !table_holds_nan(table))
    table_fold<false, T>(codes, table, scales, M, d, block, coef, init, out, nullptr, bad_out, msq_out);
  else
    table_fold<true, T>(codes, table, scales, M, d, block, coef, init, out, sq_out, bad_out, msq_out);
}

// One tile of n columns from lo, which may span blocks (as fold_tile): acc[t] += cs[r * ld + i] * e4m3(q_i[t]);
// inner[r * ld + i] += sum of e4m3(q_i)^2 over block r's columns (float64); bad[i] |= a NaN code. Portable here;
// float32 on AVX2 below.
template <typename T>
void e4m3_tile(const uint8_t* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld, int64_t block, const T* cs,
               T* acc, double* inner, uint8_t* bad) {
  block_segments(codes, lo, n, M, ld, block, cs, acc,
                 [&](int64_t r, int64_t i, const uint8_t* q, int64_t len, T c, T* a) {
    double sq = 0.0;
    int nan = 0;
    for (int64_t t = 0; t < len; ++t) {
      const float v = e4m3_value(q[t]);
      a[t] += c * static_cast<T>(v);
      sq += static_cast<double>(v) * static_cast<double>(v);
      nan |= (q[t] & 0x7F) == 0x7F;
    }
    inner[r * ld + i] += sq;
    bad[i] |= nan != 0;
  });
}

#ifdef __AVX2__
namespace {
// 8 e4m3 bytes as float32 without a table or a blend: the byte moved to the top of a lane (sign at bit 31), its
// 7 magnitude bits shifted down into the float's exponent's low 4 bits and mantissa's top 3 (an e = 0 code becomes
// a float32 subnormal, which is the same number there), then times 2^(127 - 7) rebiases the exponent. NaN codes
// decode as 480 (the caller flags them).
inline __m256 e4m3_floats(const uint8_t* p) {
  const __m256i top = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 24);
  const __m256i mag = _mm256_srli_epi32(_mm256_and_si256(top, _mm256_set1_epi32(0x7F000000)), 4);
  const __m256i bits = _mm256_or_si256(mag, _mm256_and_si256(top, _mm256_set1_epi32(static_cast<int>(0x80000000u))));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

// The last n < 64 columns of a register-blocked e4m3 tile, from lo, in one block (coefficients cs[i], squares into
// inner[i]): shared by the AVX2 and AVX-512 tiles.
inline void e4m3_tail(const uint8_t* const* codes, int64_t lo, int64_t n, int64_t M, const float* cs, float* acc,
                      double* inner, uint8_t* bad) {
  for (int64_t i = 0; i < M; ++i) {
    const uint8_t* q = codes[i] + lo;
    double s = 0.0;
    int flagged = 0;
    for (int64_t t = 0; t < n; ++t) {
      const float v = e4m3_value(q[t]);
      acc[t] += cs[i] * v;
      s += static_cast<double>(v) * static_cast<double>(v);
      flagged |= (q[t] & 0x7F) == 0x7F;
    }
    inner[i] += s;
    bad[i] |= flagged != 0;
  }
}
}  // namespace

// float32 on AVX2, register-blocked (register_blocked_tile): the squares of each client in float64 (exact per
// element), handed over per block; NaN codes (0x7F, 0xFF) found 32 bytes at a time.
template <>
void e4m3_tile<float>(const uint8_t* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld, int64_t block,
                      const float* cs, float* acc, double* inner, uint8_t* bad) {
  constexpr int64_t kMaxM = 32;
  if (M > kMaxM) {
    for (int64_t i0 = 0; i0 < M; i0 += kMaxM)
      e4m3_tile<float>(codes + i0, lo, n, std::min(kMaxM, M - i0), ld, block, cs + i0, acc, inner + i0, bad + i0);
    return;
  }
  __m256d sq[kMaxM];
  __m256i nan[kMaxM];
  for (int64_t i = 0; i < M; ++i) {
    sq[i] = _mm256_setzero_pd();
    nan[i] = _mm256_setzero_si256();
  }
  const __m256i low7 = _mm256_set1_epi8(0x7F);
  register_blocked_tile(
      codes, lo, n, M, ld, block, cs, acc,
      [&](int64_t i, const uint8_t* src, __m256 c, __m256* a) {
        __m256d s = sq[i];
        for (int k = 0; k < 8; ++k) {
          const __m256 v = e4m3_floats(src + 8 * k);
          a[k] = _mm256_fmadd_ps(c, v, a[k]);
          const __m256d v0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), v1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
          s = _mm256_fmadd_pd(v0, v0, _mm256_fmadd_pd(v1, v1, s));
        }
        sq[i] = s;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
        nan[i] = _mm256_or_si256(nan[i], _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, low7), low7),
                                                         _mm256_cmpeq_epi8(_mm256_and_si256(y, low7), low7)));
      },
      [&](int64_t r) {
        for (int64_t i = 0; i < M; ++i) {
          alignas(32) double lanes[4];
          _mm256_store_pd(lanes, sq[i]);
          inner[r * ld + i] += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
          sq[i] = _mm256_setzero_pd();
        }
      },
      [&](int64_t r, int64_t whole) { e4m3_tail(codes, lo + whole, n - whole, M, cs + r * ld, acc + whole, inner + r * ld, bad); });
  for (int64_t i = 0; i < M; ++i) bad[i] |= !_mm256_testz_si256(nan[i], nan[i]);
}
#endif

#ifdef FASTAGG_AVX512
namespace {
// e4m3_tile<float> on AVX-512: the AVX2 tile's decode (e4m3_floats) 16 codes a register; the same float32 FMAs in
// the same client order (the mean's bits equal the AVX2 path's), the squares in float64 over eight lanes (exact per
// element; summed in another order than on AVX2), NaN codes by byte compares into a mask.
struct E4m3Tile512 {
  static constexpr int64_t kMaxM = 32;
  const uint8_t* const* codes;
  int64_t lo, n, M, ld;
  const float* cs;
  float* acc;
  double* inner;
  uint8_t* bad;
  __m512d* sq;     // [M] per client: float64 squares in this block
  __mmask64* nan;  // [M] per client: bytes seen holding a NaN code

  FASTAGG_AVX512_TILE void client(int64_t i, const uint8_t* src, __m512 c, __m512* a) {
    const __m512i mag_bits = _mm512_set1_epi32(0x7F000000);
    const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    __m512d s = sq[i];
    for (int k = 0; k < 4; ++k) {
      const __m512i top = _mm512_slli_epi32(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * k))), 24);
      const __m512i bits = _mm512_or_si512(_mm512_srli_epi32(_mm512_and_si512(top, mag_bits), 4),
                                           _mm512_and_si512(top, sign_bit));
      const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
      a[k] = _mm512_fmadd_ps(c, v, a[k]);
      const __m512d v0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
      const __m512d v1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
      s = _mm512_fmadd_pd(v0, v0, _mm512_fmadd_pd(v1, v1, s));
    }
    sq[i] = s;
    const __m512i low7 = _mm512_set1_epi8(0x7F);
    nan[i] |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(src), low7), low7);
  }
  FASTAGG_AVX512_TILE void hand_over(int64_t r) { hand_over_pd8(sq, M, inner + r * ld); }
  void tail(int64_t r, int64_t whole) {
    e4m3_tail(codes, lo + whole, n - whole, M, cs + r * ld, acc + whole, inner + r * ld, bad);
  }
};

FASTAGG_AVX512_TILE void e4m3_tile_avx512(const uint8_t* const* codes, int64_t lo, int64_t n, int64_t M, int64_t ld,
                                          int64_t block, const float* cs, float* acc, double* inner, uint8_t* bad) {
  constexpr int64_t kMaxM = E4m3Tile512::kMaxM;
  if (M > kMaxM) {
    for (int64_t i0 = 0; i0 < M; i0 += kMaxM)
      e4m3_tile_avx512(codes + i0, lo, n, std::min(kMaxM, M - i0), ld, block, cs + i0, acc, inner + i0, bad + i0);
    return;
  }
  __m512d sq[kMaxM];
  __mmask64 nan[kMaxM];
  for (int64_t i = 0; i < M; ++i) {
    sq[i] = _mm512_setzero_pd();
    nan[i] = 0;
  }
  E4m3Tile512 v{codes, lo, n, M, ld, cs, acc, inner, bad, sq, nan};
  register_blocked_tile512(codes, lo, n, M, ld, block, cs, acc, v);
  for (int64_t i = 0; i < M; ++i) bad[i] |= nan[i] != 0;
}
}  // namespace
#endif

template <typename T>
void e4m3_blockwise_fold(const uint8_t* const* codes, const float* const* scales, int64_t M, int64_t d,
                         int64_t block, const double* coef, const T* init, T* out, double* sq_out, uint8_t* bad_out,
                         double* msq_out) {
  auto fold = e4m3_tile<T>;
#ifdef FASTAGG_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (avx512_tiles_usable()) fold = e4m3_tile_avx512;
  }
#endif
  blockwise_sweep<T>(scales, M, d, block, coef, init, out, sq_out, bad_out, msq_out, 1, true,
                     [&](int64_t lo, int64_t n, const T* cs, T* acc, double* inner, uint8_t* bad) {
                       fold(codes, lo, n, M, M, block, cs, acc, inner, bad);
                     });
}

namespace {
double sum_of_squares(const float* v, int64_t n) {  // float64, eight interleaved partial sums (no n-long add chain)
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t whole = n - n % 8;
  for (int64_t j = 0; j < whole; j += 8)
    for (int q = 0; q < 8; ++q) part[q] += static_cast<double>(v[j + q]) * static_cast<double>(v[j + q]);
  for (int64_t j = whole; j < n; ++j) part[j - whole] += static_cast<double>(v[j]) * static_cast<double>(v[j]);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}
}  // namespace

template <typename T, typename I>
void sparse_fold(const I* const* idx, const float* const* vals, const int64_t* k, int64_t M, const double* coef,
                 const T* init, T* out, int64_t d, double* sq_out, double* msq_out) {
  int64_t total = 0;
  for (int64_t i = 0; i < M; ++i) total += k[i];
#pragma omp parallel for schedule(static) num_threads(threads_for(total * int64_t(sizeof(float) + sizeof(I))))
  for (int64_t i = 0; i < M; ++i) sq_out[i] = sum_of_squares(vals[i], k[i]);
  // out cut into fixed ranges of kChunk elements (L2-sized): each range is started (init or zeros), takes every
  // client's entries that fall in it, client by client (sorted indices: a binary search finds them), and is squared
  // while it is still in cache, so out is written once and each element gets its additions in client order
  // whatever the thread count; no two threads write one element.
  const int64_t ranges = (d + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<size_t>(ranges), 0.0);
#pragma omp parallel for schedule(static) num_threads(threads_for(d * int64_t(2 * sizeof(T)) + total * 16))
  for (int64_t r = 0; r < ranges; ++r) {
    const int64_t lo = r * kChunk, hi = std::min(d, lo + kChunk);
    if (init == nullptr) {
      std::fill(out + lo, out + hi, T(0));
    } else if (init != out) {
      std::copy(init + lo, init + hi, out + lo);
    }
    for (int64_t i = 0; i < M; ++i) {
      const auto below = [](I a, int64_t b) { return static_cast<int64_t>(a) < b; };
      const I* first = std::lower_bound(idx[i], idx[i] + k[i], lo, below);
      const I* last = std::lower_bound(first, idx[i] + k[i], hi, below);
      const double c = coef[i];
      const float* v = vals[i] + (first - idx[i]);
      for (const I* p = first; p < last; ++p, ++v) out[*p] += static_cast<T>(c * static_cast<double>(*v));
    }
    if (msq_out != nullptr) {
      double sq[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const int64_t whole = lo + (hi - lo) - (hi - lo) % 8;
      for (int64_t j = lo; j < whole; j += 8)
        for (int q = 0; q < 8; ++q) sq[q] += static_cast<double>(out[j + q]) * static_cast<double>(out[j + q]);
      for (int64_t j = whole; j < hi; ++j) sq[j - whole] += static_cast<double>(out[j]) * static_cast<double>(out[j]);
      part[r] = ((sq[0] + sq[1]) + (sq[2] + sq[3])) + ((sq[4] + sq[5]) + (sq[6] + sq[7]));
    }
  }
  if (msq_out == nullptr) return;
  double msq = 0.0;
  for (double p : part) msq += p;
  *msq_out = msq;
}

namespace {
// max_j |p_j| over a block in float64, and whether every p_j is finite (a NaN would not raise the maximum: it is
// counted apart). Both reductions vectorize.
template <typename X>
double block_absmax(const X* p, int64_t n, int64_t& nonfinite) {
  double amax = 0.0;
  int ok = 1;
#pragma omp simd reduction(max : amax) reduction(& : ok)
  for (int64_t j = 0; j < n; ++j) {
    const double a = std::fabs(static_cast<double>(p[j]));
    amax = a > amax ? a : amax;
    ok &= (a - a) == 0.0;  // NaN for NaN and Inf
  }
  nonfinite += ok ? 0 : 1;
  return amax;
}
}  // namespace

// The loop both row quantizers share: per (row, block), in parallel, the block's float64 absmax (and its count of
// NaN/Inf), the float32 scale float32(absmax / top) (1 for a zero block) stored, then write(i, row, lo, hi, sd)
// writes the block's codes from sd = double(scale). Returns the number of blocks holding a NaN or Inf.
template <typename X, typename Write>
int64_t quantize_blocks(const X* x, int64_t M, int64_t d, int64_t block, double top, float* scales,
                        const Write& write) {
  const int64_t nb = (d + block - 1) / block;
  int64_t nonfinite = 0;
#pragma omp parallel for schedule(static) reduction(+ : nonfinite) \
    num_threads(threads_for(M * d * int64_t(sizeof(X) + 1)))
  for (int64_t r = 0; r < M * nb; ++r) {
    const int64_t i = r / nb, b = r % nb;
    const X* row = x + i * d;
    const int64_t lo = b * block, hi = std::min(d, lo + block);
    const double amax = block_absmax(row + lo, hi - lo, nonfinite);
    // amax / top rounded to float32 (beyond float32: Inf, then refused by the caller; a cast of a double past the
    // float range would be undefined behaviour): float32 rounds to nearest, Inf from 2^128 - 2^103 up
    const double q = amax / top;
    float s = amax <= 0.0 ? 1.0f : q <= FLT_MAX ? static_cast<float>(q) : q < 0x1.ffffffp127 ? FLT_MAX : INFINITY;
    // a subnormal (or underflowing) scale rounded down goes one step up: never 0, and |x| / s <= top
    if (s < FLT_MIN && static_cast<double>(s) * top < amax) s = std::nextafter(s, INFINITY);
    scales[i * nb + b] = s;
    write(i, row, lo, hi, static_cast<double>(s));
  }
  return nonfinite;
}

template <typename X>
int64_t quantize_int8_rows(const X* x, int64_t M, int64_t d, int64_t block, bool stochastic, uint64_t seed,
                           uint32_t round, const uint32_t* clients, int8_t* codes, float* scales) {
  const uint32_t key[2] = {static_cast<uint32_t>(seed & 0xFFFFFFFFu), static_cast<uint32_t>(seed >> 32)};
  return quantize_blocks(x, M, d, block, 127.0, scales, [&](int64_t i, const X* row, int64_t lo, int64_t hi, double sd) {
    int8_t* out = codes + i * d;
    if (!stochastic) {
      for (int64_t j = lo; j < hi; ++j) {  // nearbyint: the default rounding mode, half to even
        const double q = std::nearbyint(static_cast<double>(row[j]) / sd);
        out[j] = static_cast<int8_t>(std::min(127.0, std::max(-127.0, q)));
      }
      return;
    }
    uint32_t words[4] = {0, 0, 0, 0};
    int64_t group = -1;
    for (int64_t j = lo; j < hi; ++j) {
      if (j / 4 != group) {  // the Philox block holding u_j: counter (j / 4 low, high, round, client), key seed
        group = j / 4;
        const uint32_t counter[4] = {static_cast<uint32_t>(group & 0xFFFFFFFF),
                                     static_cast<uint32_t>(static_cast<uint64_t>(group) >> 32), round, clients[i]};
        philox4x32_10(counter, key, words);
      }
      const double q = std::floor(static_cast<double>(row[j]) / sd + static_cast<double>(words[j % 4]) * 0x1p-32);
      out[j] = static_cast<int8_t>(std::min(127.0, std::max(-127.0, q)));
    }
  });
}

namespace {
// float32 -> e4m3 (finite, |f| <= 448), round to nearest even: c10's fp8e4m3fn_from_fp32_value, branch-free so
// that a loop over it vectorizes. Below 2^-6 (the smallest normal) the float is added to 2^(141-127) = 2^14, so the
// float adder rounds the subnormal mantissa (steps of 2^-9) to nearest even; above, the mantissa keeps 3 bits
// (bias 127 -> 7) rounded half to even; from 464 up (not reached after the clamp to 448) the NaN code.
inline uint8_t e4m3_code(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  constexpr uint32_t denorm = 141u << 23;
  float a, m;
  std::memcpy(&a, &bits, 4);
  std::memcpy(&m, &denorm, 4);
  const float sum = a + m;
  uint32_t sb;
  std::memcpy(&sb, &sum, 4);
  const uint32_t sub = sb - denorm;
  const uint32_t normal = (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
  uint32_t code = bits < (121u << 23) ? sub : normal;
  code = bits >= (1087u << 20) ? 0x7Fu : code;
  return static_cast<uint8_t>((code | (sign >> 24)) & 0xFFu);
}
}  // namespace

// v[t] = float32(clamp(double(x[t]) / sd, +-448)) and codes[t] = e4m3_code(v[t]) for t < n: the portable loops,
// then 8 at a time on AVX2 (float64 quotients 4 at a time; the code's integer steps in 8 lanes, packed to bytes).
template <typename X>
void fp8_piece(const X* x, double sd, int64_t n, float* v, uint8_t* out) {
  for (int64_t t = 0; t < n; ++t) v[t] = static_cast<float>(std::min(448.0, std::max(-448.0, static_cast<double>(x[t]) / sd)));
  for (int64_t t = 0; t < n; ++t) out[t] = e4m3_code(v[t]);
}

#ifdef __AVX2__
namespace {
inline __m128 fp8_quotients(__m256d q, __m256d lim) {  // clamp(q, +-448) to float32: the scalar min/max order
  return _mm256_cvtpd_ps(_mm256_min_pd(lim, _mm256_max_pd(_mm256_sub_pd(_mm256_setzero_pd(), lim), q)));
}

inline __m256 fp8_quotients8(const float* x, __m256d s, __m256d lim) {
  const __m128 lo = fp8_quotients(_mm256_div_pd(_mm256_cvtps_pd(_mm_loadu_ps(x)), s), lim);
  const __m128 hi = fp8_quotients(_mm256_div_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + 4)), s), lim);
  return _mm256_set_m128(hi, lo);
}

inline __m256 fp8_quotients8(const double* x, __m256d s, __m256d lim) {
  const __m128 lo = fp8_quotients(_mm256_div_pd(_mm256_loadu_pd(x), s), lim);
  const __m128 hi = fp8_quotients(_mm256_div_pd(_mm256_loadu_pd(x + 4), s), lim);
  return _mm256_set_m128(hi, lo);
}

inline void e4m3_codes8(__m256 v, uint8_t* out) {  // e4m3_code in 8 lanes
  const __m256i all = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(all, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i bits = _mm256_xor_si256(all, sign);
  const __m256i denorm = _mm256_set1_epi32(141 << 23);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(denorm))), denorm);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(static_cast<int>((static_cast<uint32_t>(7 - 127) << 23) +
                                                                                  0x7FFFFu))),
                       odd),
      20);
  __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), bits));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(bits, _mm256_set1_epi32((1087 << 20) - 1)));
  code = _mm256_and_si256(_mm256_or_si256(code, _mm256_srli_epi32(sign, 24)), _mm256_set1_epi32(0xFF));
  const __m256i w = _mm256_packus_epi32(code, code);  // 16-bit, then bytes (every value <= 255)
  const __m256i b = _mm256_packus_epi16(w, w);
  const __m128i both = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), both);
}
}  // namespace

template <>
void fp8_piece<float>(const float* x, double sd, int64_t n, float* v, uint8_t* out) {
  const __m256d s = _mm256_set1_pd(sd), lim = _mm256_set1_pd(448.0);
  const int64_t whole = n - n % 8;
  for (int64_t t = 0; t < whole; t += 8) e4m3_codes8(fp8_quotients8(x + t, s, lim), out + t);
  (void)v;
  for (int64_t t = whole; t < n; ++t)
    out[t] = e4m3_code(static_cast<float>(std::min(448.0, std::max(-448.0, static_cast<double>(x[t]) / sd))));
}

template <>
void fp8_piece<double>(const double* x, double sd, int64_t n, float* v, uint8_t* out) {
  const __m256d s = _mm256_set1_pd(sd), lim = _mm256_set1_pd(448.0);
  const int64_t whole = n - n % 8;
  for (int64_t t = 0; t < whole; t += 8) e4m3_codes8(fp8_quotients8(x + t, s, lim), out + t);
  for (int64_t t = whole; t < n; ++t)
    out[t] = e4m3_code(static_cast<float>(std::min(448.0, std::max(-448.0, x[t] / sd))));
  (void)v;
}
#endif

template <typename X>
int64_t quantize_fp8_rows(const X* x, int64_t M, int64_t d, int64_t block, uint8_t* codes, float* scales) {
  constexpr int64_t kPiece = 512;  // quotients staged in float32 on the stack, then converted: two simple loops
  return quantize_blocks(x, M, d, block, 448.0, scales, [&](int64_t i, const X* row, int64_t lo, int64_t hi, double sd) {
    alignas(32) float v[kPiece];
    for (int64_t p = lo; p < hi; p += kPiece) fp8_piece<X>(row + p, sd, std::min(kPiece, hi - p), v, codes + i * d + p);
  });
}

template int64_t quantize_fp8_rows<float>(const float*, int64_t, int64_t, int64_t, uint8_t*, float*);
template int64_t quantize_fp8_rows<double>(const double*, int64_t, int64_t, int64_t, uint8_t*, float*);

template int64_t quantize_int8_rows<float>(const float*, int64_t, int64_t, int64_t, bool, uint64_t, uint32_t,
                                        const uint32_t*, int8_t*, float*);
template int64_t quantize_int8_rows<double>(const double*, int64_t, int64_t, int64_t, bool, uint64_t, uint32_t,
                                         const uint32_t*, int8_t*, float*);

template void int8_blockwise_fold<float>(const int8_t* const*, const float* const*, int64_t, int64_t, int64_t,
                                         const double*, const float*, float*, double*, uint8_t*, double*);
template void int8_blockwise_fold<double>(const int8_t* const*, const float* const*, int64_t, int64_t, int64_t,
                                          const double*, const double*, double*, double*, uint8_t*, double*);

template void table_blockwise_fold<float>(const uint8_t* const*, const float*, const float* const*, int64_t, int64_t,
                                          int64_t, const double*, const float*, float*, double*, uint8_t*, double*);
template void table_blockwise_fold<double>(const uint8_t* const*, const float*, const float* const*, int64_t, int64_t,
                                           int64_t, const double*, const double*, double*, double*, uint8_t*,
                                           double*);
template void e4m3_blockwise_fold<float>(const uint8_t* const*, const float* const*, int64_t, int64_t, int64_t,
                                         const double*, const float*, float*, double*, uint8_t*, double*);
template void e4m3_blockwise_fold<double>(const uint8_t* const*, const float* const*, int64_t, int64_t, int64_t,
                                          const double*, const double*, double*, double*, uint8_t*, double*);
template void sparse_fold<float, int64_t>(const int64_t* const*, const float* const*, const int64_t*, int64_t,
                                           const double*, const float*, float*, int64_t, double*, double*);
template void sparse_fold<double, int64_t>(const int64_t* const*, const float* const*, const int64_t*, int64_t,
                                           const double*, const double*, double*, int64_t, double*, double*);
template void sparse_fold<float, int32_t>(const int32_t* const*, const float* const*, const int64_t*, int64_t,
                                           const double*, const float*, float*, int64_t, double*, double*);
template void sparse_fold<double, int32_t>(const int32_t* const*, const float* const*, const int64_t*, int64_t,
                                           const double*, const double*, double*, int64_t, double*, double*);

}  // namespace fastagg
