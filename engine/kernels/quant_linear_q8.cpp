// Block matmuls on int8 activations (ModelConfig.activation_quant "int8"): y[M, N] = x[M, K] @ W^T
// with x quantized per 32-element block (kvserve::Q8Act, llama.cpp's Q8_0/Q8_1 activations) and W
// the strip-packed Q4_1 / Q8_0 blocks or the GGUF rows of Q4_K / Q6_K that quant_linear.cpp reads,
// as they are (the same bytes the fp32 kernel reads; no second copy). Other formats, and CPUs
// without AVX2, have no int8 kernel here (q8_supported): callers multiply fp32 activations.
//
// Why: the fp32 kernel expands every 4-bit code to fp32 and FMAs it, ~5 vector ops per 8
// multiply-adds, which makes decode compute bound on AVX2 (no AVX-512) at ~1/3 of the memory
// bandwidth. Integer dot products do 32 multiply-adds per `_mm256_maddubs_epi16` (Q4_1) or 16 per
// `_mm256_madd_epi16` (Q8_0), and the scales are applied once per block of 32.
//
// What it computes: per row r, strip column c and block b, an exact integer dot product
// I = sum_k q_x[k] * q_w[k] (int16 / int32 lanes, no overflow: |q_w| <= 15 or 128, |q_x| <= 127),
// then acc += (d_w * d_x) * I (+ m_w * s_x for Q4_1) in fp32. So the result equals
// F.linear(dequant(quant(x)), dequant(W)) up to fp32 rounding of those per-block terms; the
// only approximation against the fp32 kernel is the activations' rounding to 8 bits.
//
// Layouts (quant_linear.cpp's strips, 8 output columns per strip, 32 k per strip-block):
//   Q4_1 (160 bytes): d[8], m[8] fp16, then 8 groups of 16 bytes; group g byte i holds column
//     i % 8 at k = 4g + i / 8 (low nibble) and k = 4g + 2 + i / 8 (high nibble), so group g is
//     k-quad g of all 8 columns. Once per strip-block (shared by every row of the pass) the codes
//     are re-laid as 8 vectors w[g] whose dword c is column c's 4 codes at k = 4g .. 4g + 3; a row
//     then multiplies w[g] by its 4 codes at k-quad g broadcast to every dword (maddubs: 16 int16
//     lanes = 8 columns x 2 k pairs), sums the 8 quads in int16 (<= 8 * 2 * 15 * 127 = 30480, no
//     saturation) and one madd by 1 gives the 8 int32 column sums. A row reads its own 32 int8
//     codes per block (an earlier layout broadcast 256 bytes of pre-expanded code pairs per row and
//     block, which at 8+ rows spilled from L1 and made the kernel L2 bound: 16 rows ran ~20% slower).
//   Q8_0 (272 bytes): d[8] fp16, then byte 16 + 8k + c = column c at k. A 32-byte load at quad j
//     is [cols@4j, cols@4j+1 | cols@4j+2, cols@4j+3]; interleaved in-lane into (column, k pair)
//     pairs (interleave_halves) and sign-extended to int16, madd with the broadcast int16 pair (x4j, x4j+1) (resp. (x4j+2, x4j+3)) gives 8 int32
//     column sums.
// Many rows: each strip-block is unpacked once and dotted with up to 16 (Q4_1) or 8 (Q8_0) rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "quant_linear.h"
#include "silu_mul.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSERVE_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kStrip = 8;
#ifndef KVSERVE_Q8_PREFETCH
#define KVSERVE_Q8_PREFETCH 1024
#endif
constexpr int64_t kPrefetch = KVSERVE_Q8_PREFETCH;  // bytes ahead of the weights being read
constexpr int64_t kQ4_1Bytes = 160, kQ8_0Bytes = 272;  // strip-block bytes (quant_linear.cpp)
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ4_K = 3, kQ6_K = 5;  // engine/quant.py BlockFormat codes
constexpr int64_t kQ4_KBytes = 144, kQ6_KBytes = 210;          // GGUF super-blocks of 256 weights

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

using kvserve::cpu_has_avx2;  // quant_linear.cpp: one CPU check for both sources

#ifdef KVSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Software prefetch of the cache lines kPrefetch bytes past a block about to be read: the weights
// stream from DRAM once per step, and with integer dot products the kernel outruns the hardware
// prefetcher (measured on one thread over 44 MB of Q4_1: ~4.5 -> ~6.5 GB/s, `sum` ~7).
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + o), _MM_HINT_T0);
}

inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Per 128-bit lane: bytes [a0..a7, b0..b7] -> [a0, b0, a1, b1, ..., a7, b7].
inline __m256i interleave_halves(__m256i v) {
  const __m256i idx = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                       0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm256_shuffle_epi8(v, idx);
}

inline void store_cols(__m256 v, float* out, int64_t cols) {
  if (cols == kStrip) {
    _mm256_storeu_ps(out, v);
  } else {
    alignas(32) float tmp[kStrip];
    _mm256_store_ps(tmp, v);
    std::copy(tmp, tmp + cols, out);
  }
}

// A Q4_1 strip-block's codes as k-quads: dword c % 4 of lane c / 4 of w[j] = column c's codes at
// k = 4j .. 4j + 3 (unsigned, 0..15).
inline void relay_q4_1(const uint8_t* sb, __m256i* w) {
  const __m256i mask = _mm256_set1_epi8(15);
  for (int o = 0; o < 4; ++o) {  // lane 0: group 2o (k-quad 2o), lane 1: group 2o + 1
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32 + 32 * o));
    const __m256i k01 = interleave_halves(_mm256_and_si256(q, mask));  // column c: (k, k + 1)
    const __m256i k23 = interleave_halves(_mm256_and_si256(_mm256_srli_epi16(q, 4), mask));
    const __m256i c03 = _mm256_unpacklo_epi16(k01, k23), c47 = _mm256_unpackhi_epi16(k01, k23);
    w[2 * o] = _mm256_permute2x128_si256(c03, c47, 0x20);
    w[2 * o + 1] = _mm256_permute2x128_si256(c03, c47, 0x31);
  }
}

// Row code quad j (k = 4j .. 4j + 3) of a block's 32 int8 codes, broadcast to every dword.
inline __m256i quad_at(const int8_t* xq, int j) {
  int32_t v;
  std::memcpy(&v, xq + 4 * j, 4);
  return _mm256_set1_epi32(v);
}

// Rows [r0, r0 + R) against one Q4_1 strip. Each strip-block is re-laid once into k-quads and
// every row then needs only broadcasts of its own codes, 4 at a time (32 bytes a block, from L1).
template <int R>
void strip_q4_1(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, float* out, int64_t ldo, int64_t cols) {
  const int64_t nb = x.K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb = strip + b * kQ4_1Bytes;
    prefetch_ahead(sb, kQ4_1Bytes);
    __m256i w[8];
    relay_q4_1(sb, w);
    const __m256 d = halves8(sb), m = halves8(sb + 16);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      const int8_t* xq = x.q8.data() + rb * kBlock;
      __m256i s = _mm256_maddubs_epi16(w[0], quad_at(xq, 0));
      for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], quad_at(xq, j)));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.d[rb])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_cols(acc[r], out + r * ldo, cols);
}

// Rows [r0, r0 + R) against one Q8_0 strip.
template <int R>
void strip_q8_0(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, float* out, int64_t ldo, int64_t cols) {
  const int64_t nb = x.K / kBlock;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb = strip + b * kQ8_0Bytes;
    prefetch_ahead(sb, kQ8_0Bytes);
    __m256i w[16];
    for (int j = 0; j < 8; ++j) {
      const __m256i q = interleave_halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * j)));
      w[2 * j] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
      w[2 * j + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    }
    const __m256 d = halves8(sb);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      const int16_t* q = x.q16.data() + (r0 + r) * x.K + b * kBlock;
      int32_t pair;
      std::memcpy(&pair, q, 4);
      __m256i s = _mm256_madd_epi16(w[0], _mm256_set1_epi32(pair));
      for (int v = 1; v < 16; ++v) {
        std::memcpy(&pair, q + 2 * v, 4);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(w[v], _mm256_set1_epi32(pair)));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x.d[rb])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_cols(acc[r], out + r * ldo, cols);
}

// ---- AVX512-VNNI (Zen 4 and 5, Ice Lake and later): vpdpbusd multiplies 4 unsigned by 4 signed
// bytes and adds the 4 products to an int32 lane in one instruction. Where two adjacent strips
// are full, Q4_1 and Q8_0 run them together in 512-bit registers (pair_q4_1 / pair_q8_0 below);
// a lone or partial strip (the end of a matrix or of a thread's range) runs the AVX2 kernel
// (for Q4_1 one ymm vpdpbusd chain per row had measured ~13% slower than maddubs + add on this
// project's Zen 5 machine). The integer sums are the AVX2 kernels', so the results are bit for
// bit the same. Compiled for that target whatever the build flags, and run only where the CPU
// has it (cpu_has_vnni).
// The K-quant row kernels below take vpdpbusd only where the build itself targets AVX512-VNNI
// (the default -march=native on such a CPU): there it sits inside their AVX2-target loops, which
// a separately targeted function could not be inlined into.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVSERVE_VNNI_BUILD 1
#endif

bool cpu_has_vnni() {
  static const bool yes = cpu_has_avx2() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw") && !std::getenv("KVSERVE_NO_VNNI");
  return yes;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")

// ---- Strip pairs in 512-bit registers (AVX512-VNNI CPUs): two adjacent full strips are 16
// columns, one zmm; the same integer dot products and the same fp32 operations per column as the
// AVX2 kernels, so every output is the same float. On Zen 5 (full-width AVX-512) one thread, 16
// rows of 1536 x 576 Q4_1: ~90 (AVX2 maddubs) -> ~145 GMAC/s; 512 rows ~190 (dense fp32 oneDNN
// ~100). Rows go in groups of 8: each k-quad's vpdpbusd then feeds 8 independent accumulators.

// The two strips' strip-blocks as k-quads, relay_q4_1 in both halves at once: dword c % 4 of
// lane c / 4 of w[j] = column c's codes at k = 4j .. 4j + 3, strip a in the low 8 columns.
inline void relay_q4_1_pair(const uint8_t* a, const uint8_t* b, __m512i* w) {
  const __m512i mask = _mm512_set1_epi8(15);
  const __m512i idx = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int o = 0; o < 4; ++o) {
    const __m512i q = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 + 32 * o))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * o)), 1);
    const __m512i k01 = _mm512_shuffle_epi8(_mm512_and_si512(q, mask), idx);
    const __m512i k23 = _mm512_shuffle_epi8(_mm512_and_si512(_mm512_srli_epi16(q, 4), mask), idx);
    const __m512i c03 = _mm512_unpacklo_epi16(k01, k23), c47 = _mm512_unpackhi_epi16(k01, k23);
    w[2 * o] = _mm512_permutex2var_epi64(c03, lo, c47);
    w[2 * o + 1] = _mm512_permutex2var_epi64(c03, hi, c47);
  }
}

// 16 fp16 scales: 8 at a, 8 at b.
inline __m512 halves16(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

inline __m512i quad_at16(const int8_t* xq, int j) {
  int32_t v;
  std::memcpy(&v, xq + 4 * j, 4);
  return _mm512_set1_epi32(v);
}

// Rows [r0, r0 + R) against strips a and a + strip_bytes (Q4_1): unsigned codes by the row's
// signed codes, vpdpbusd as it is.
template <int R>
void pair_q4_1(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, int64_t strip_bytes, float* out,
               int64_t ldo) {
  static_assert(R <= 8, "one group of accumulators");
  const int64_t nb = x.K / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *sa = strip + b * kQ4_1Bytes, *sb = sa + strip_bytes;
    prefetch_ahead(sa, kQ4_1Bytes), prefetch_ahead(sb, kQ4_1Bytes);
    __m512i w[8];
    relay_q4_1_pair(sa, sb, w);
    const __m512 d = halves16(sa, sb), m = halves16(sa + 16, sb + 16);
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < R; ++r) s[r] = _mm512_dpbusd_epi32(s[r], w[j], quad_at16(x.q8.data() + ((r0 + r) * nb + b) * kBlock, j));
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(x.d[rb])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// Rows [r0, r0 + R) against two Q8_0 strips. Both sides are signed, so the row's codes go in
// the unsigned operand offset by 128 (Q8Act::u8) and the strip-block's column sums times 128
// come off: sum (x + 128) w - 128 sum w = sum x w, exact in int32.
template <int R>
void pair_q8_0(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, int64_t strip_bytes, float* out,
               int64_t ldo) {
  static_assert(R <= 8, "one group of accumulators");
  const int64_t nb = x.K / kBlock;
  // dword c of each 256-bit half <- (word c of its low lane, word c of its high lane): the
  // (k, k + 1) and (k + 2, k + 3) pairs of column c after interleave_halves
  const __m512i words = _mm512_set_epi16(31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17, 24, 16,
                                         15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *sa = strip + b * kQ8_0Bytes, *sb = sa + strip_bytes;
    prefetch_ahead(sa, kQ8_0Bytes), prefetch_ahead(sb, kQ8_0Bytes);
    __m512i w[8], sum128 = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i q = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sa + 16 + 32 * j))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * j)), 1);
      w[j] = _mm512_permutexvar_epi16(words, _mm512_shuffle_epi8(q, pairs));
      sum128 = _mm512_dpbusd_epi32(sum128, bias, w[j]);
    }
    const __m512 d = halves16(sa, sb);
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < R; ++r) {
        const auto* xu = reinterpret_cast<const int8_t*>(x.u8.data()) + ((r0 + r) * nb + b) * kBlock;
        s[r] = _mm512_dpbusd_epi32(s[r], quad_at16(xu, j), w[j]);
      }
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], sum128));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(x.d[rb])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

#pragma GCC pop_options

// ---- Row formats (GGUF rows as stored, super-blocks of 256 along K: 8 of the activations'
// 32-blocks). Per output feature n and row: for each 32 weights an integer dot product of the
// codes (maddubs of unsigned codes by the int8 activations), scaled in fp32 by the weight's
// sub-block scale times the activations' block scale; the offsets (Q4_K's mins, Q6_K's -32)
// through the activations' block sums.
//   Q4_K: w = (d sc_j) q - (dmin m_j), sub-block j of 32: dot = d sc_j dx_j I_j - dmin m_j s_j.
//   Q6_K: w = (d sc_i) (q - 32), sub-blocks of 16 (two per 32-block, the scales applied by madd):
//         dot = d dx (sc_a I_a + sc_b I_b) - 32 d dx (sc_a S_a + sc_b S_b), S the code sums of 16.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 vectors of 8 int32 -> [sum(v[0]), ..., sum(v[7])] (exact).
inline __m256i sums8_epi32(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The 8 32-byte blocks v[j] of a super-block as 4-byte groups v[j].t (k = 32 j + 4 t .. + 3)
// -> out[4 g + i] = [v[4g].i v[4g+1].i v[4g+2].i v[4g+3].i | the same at t = i + 4]: a dword
// lane then holds one block j = 4 g + lane % 4 (Q8Act::kq is the activations in this order).
inline void transpose_k(const __m256i* v, __m256i* out) {
  for (int g = 0; g < 2; ++g) {
    const __m256i* w = v + 4 * g;
    const __m256i a0 = _mm256_unpacklo_epi32(w[0], w[1]), a1 = _mm256_unpackhi_epi32(w[0], w[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(w[2], w[3]), a3 = _mm256_unpackhi_epi32(w[2], w[3]);
    out[4 * g] = _mm256_unpacklo_epi64(a0, a2), out[4 * g + 1] = _mm256_unpackhi_epi64(a0, a2);
    out[4 * g + 2] = _mm256_unpacklo_epi64(a1, a3), out[4 * g + 3] = _mm256_unpackhi_epi64(a1, a3);
  }
}

// Q4_K's 8 6-bit sub-block scales and mins (as gguf's dequantize reads them) times d and dmin,
// unpacked as 32-bit words: words 0-1 the 8 scales, 2-3 the 8 mins, one byte each.
inline void q4_k_scales(const uint8_t* b, __m256& dsc, __m256& dm) {
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  uint32_t s[3], u[4];
  std::memcpy(s, b + 4, 12);
  u[0] = s[0] & k6;
  u[1] = (s[2] & k4) | (((s[0] >> 6) & k2) << 4);
  u[2] = s[1] & k6;
  u[3] = ((s[2] >> 4) & k4) | (((s[1] >> 6) & k2) << 4);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  dsc = _mm256_mul_ps(_mm256_set1_ps(half_at(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
  dm = _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}

// One super-block against rows [r0, r0 + R) (R = 0: rn rows, a run-time count): the codes and
// scales are unpacked once and every row is dotted from registers, so a pass over the weights
// serves up to kKRows rows. Per row the 8 integer dot products of the 32-blocks are reduced
// exactly to one int32 vector [I_0 .. I_7] (int16 / int32 horizontal adds, no overflow), then
// converted and scaled with one fmadd: acc += I * (weight scale * activation scale), lane j
// for 32-block j; each row's result is independent of the other rows in the pass.
// (prefetch_ahead: the weights kPrefetch bytes on; rows n, n + 1, ... are contiguous)
struct Q4_KRows {
  static constexpr int64_t kBytes = kQ4_KBytes;
  template <int R>
  static inline void block(const uint8_t* b, const kvserve::Q8Act& x, int64_t r0, int rn, int64_t sb, __m256* acc,
                           __m256* corr) {
    const int nr = R ? R : rn;
    __m256 dscv, dmv;  // d * sc_j, dmin * m_j
    q4_k_scales(b, dscv, dmv);
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i q[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      q[2 * c] = _mm256_and_si256(v, mask);
      q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
    const int64_t nbx = x.K / kBlock;
    if (R == 1) {  // one row: three levels of int16 horizontal adds, cheaper than transposing the codes
      const int64_t xb = r0 * nbx + 8 * sb;
      const __m256i* xq = reinterpret_cast<const __m256i*>(x.q8.data() + r0 * x.K + 256 * sb);
      __m256i u[8];  // 16 int16 pair sums each, |.| <= 2 * 15 * 127
      for (int j = 0; j < 8; ++j) u[j] = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256(xq + j));
      // lane half h of u[j] -> int16 j of half h (|.| <= 30480)
      const __m256i h = _mm256_hadd_epi16(
          _mm256_hadd_epi16(_mm256_hadd_epi16(u[0], u[1]), _mm256_hadd_epi16(u[2], u[3])),
          _mm256_hadd_epi16(_mm256_hadd_epi16(u[4], u[5]), _mm256_hadd_epi16(u[6], u[7])));
      const __m256i dot = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(h)),
                                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(h, 1)));
      const __m256 dx = _mm256_loadu_ps(x.d.data() + xb);
      acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dscv, dx), acc[0]);
      corr[0] = _mm256_fmadd_ps(dmv, _mm256_loadu_ps(x.s.data() + xb), corr[0]);
      return;
    }
    // many rows: transpose the codes once (transpose_k), so that with Q8Act::kq each row's dot
    // products are vertical adds: the same exact integers as the one-row path
    __m256i t[8];
    transpose_k(q, t);
    const __m256i ones = _mm256_set1_epi16(1);
    const bool vnni = cpu_has_vnni();
    for (int r = 0; r < nr; ++r) {
      const int64_t xb = (r0 + r) * nbx + 8 * sb;
      const __m256i* xq = reinterpret_cast<const __m256i*>(x.kq.data() + (r0 + r) * x.K + 256 * sb);
      __m256i half[2];  // [I_4g .. I_4g+3 (t 0-3) | the same (t 4-7)] for g = 0, 1
      for (int g = 0; g < 2; ++g) {
#ifdef KVSERVE_VNNI_BUILD
        if (vnni) {  // the same integers, 4 products per int32 lane per instruction (two short chains)
          const __m256i* xg = xq + 4 * g;
          const __m256i a = _mm256_dpbusd_epi32(_mm256_setzero_si256(), t[4 * g], _mm256_loadu_si256(xg));
          const __m256i b = _mm256_dpbusd_epi32(_mm256_setzero_si256(), t[4 * g + 2], _mm256_loadu_si256(xg + 2));
          half[g] = _mm256_add_epi32(_mm256_dpbusd_epi32(a, t[4 * g + 1], _mm256_loadu_si256(xg + 1)),
                                     _mm256_dpbusd_epi32(b, t[4 * g + 3], _mm256_loadu_si256(xg + 3)));
          continue;
        }
#endif
        __m256i u = _mm256_maddubs_epi16(t[4 * g], _mm256_loadu_si256(xq + 4 * g));
        for (int i = 1; i < 4; ++i)  // |.| <= 4 * 2 * 15 * 127
          u = _mm256_add_epi16(u, _mm256_maddubs_epi16(t[4 * g + i], _mm256_loadu_si256(xq + 4 * g + i)));
        half[g] = _mm256_madd_epi16(u, ones);
      }
      const __m256i dot = _mm256_add_epi32(_mm256_permute2x128_si256(half[0], half[1], 0x20),
                                           _mm256_permute2x128_si256(half[0], half[1], 0x31));
      const __m256 dx = _mm256_loadu_ps(x.d.data() + xb);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dscv, dx), acc[r]);
      corr[r] = _mm256_fmadd_ps(dmv, _mm256_loadu_ps(x.s.data() + xb), corr[r]);
    }
  }
};

struct Q6_KRows {
  static constexpr int64_t kBytes = kQ6_KBytes;
  template <int R>
  static inline void block(const uint8_t* b, const kvserve::Q8Act& x, int64_t r0, int rn, int64_t sb, __m256* acc,
                           __m256*) {
    const int nr = R ? R : rn;
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    __m256i q[8], scv[8];
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const auto high = [&](int shift) {
        return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m2), 4);
      };
      q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), high(0));
      q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), high(2));
      q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(4));
      q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(6));
      // the 32 weights of group g: first 16 scale sc[2g], last 16 sc[2g + 1] (int16 lanes, by one shuffle)
      const __m256i w = _mm256_broadcastsi128_si256(
          _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h))));
      const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
      for (int g = 0; g < 4; ++g)
        scv[4 * h + g] = _mm256_shuffle_epi8(w, _mm256_add_epi8(pick, _mm256_set1_epi8(static_cast<char>(4 * g))));
    }
    // the 16 scales as int16, for the -32 offset: 32 * (sc[2g] * S[2g] + sc[2g + 1] * S[2g + 1])
    const __m128i sc16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m256i sc_words = _mm256_cvtepi8_epi16(sc16);
    const __m256 dv = _mm256_set1_ps(d);
    // many rows: the codes transposed (transpose_k) and their scales in the same lanes: dword
    // lane m of tsc[g] is block 4g + m % 4's first-16 scale in the low half (t 0-3), second in the high
    __m256i t[8], tsc[2], tsc32[2];  // tsc32: the same scales, one int32 per lane
    const bool vnni = cpu_has_vnni();
    if (R != 1) {
      transpose_k(q, t);
      for (int g = 0; g < 2; ++g) {
        const char a = static_cast<char>(8 * g);
        tsc[g] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
            sc16, _mm_setr_epi8(a, a, a + 2, a + 2, a + 4, a + 4, a + 6, a + 6, a + 1, a + 1, a + 3, a + 3, a + 5, a + 5,
                                a + 7, a + 7)));
        tsc32[g] = _mm256_srai_epi32(_mm256_slli_epi32(tsc[g], 16), 16);
      }
    }
    const int64_t nbx = x.K / kBlock;
    for (int r = 0; r < nr; ++r) {
      const int64_t xb = (r0 + r) * nbx + 8 * sb;
      const __m256i* xq = reinterpret_cast<const __m256i*>(x.q8.data() + (r0 + r) * x.K + 256 * sb);
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum16.data() + (r0 + r) * (x.K / 16) + 16 * sb));
      __m256i sum;  // [sum of block j's scaled products] j = 0..7 (exact)
      if (R == 1) {
        __m256i p[8];  // 8 int32 scaled pair sums each
        for (int g = 0; g < 8; ++g) p[g] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], _mm256_loadu_si256(xq + g)), scv[g]);
        sum = sums8_epi32(p);
      } else {  // the transposed codes (see Q4_KRows): vertical int32 adds
        const __m256i* tx = reinterpret_cast<const __m256i*>(x.kq.data() + (r0 + r) * x.K + 256 * sb);
        __m256i half[2];
        for (int g = 0; g < 2; ++g) {
#ifdef KVSERVE_VNNI_BUILD
          if (vnni) {  // a lane's 4 quads share one scale: sum the products, then scale once (exact)
            __m256i u = _mm256_dpbusd_epi32(_mm256_setzero_si256(), t[4 * g], _mm256_loadu_si256(tx + 4 * g));
            for (int i = 1; i < 4; ++i) u = _mm256_dpbusd_epi32(u, t[4 * g + i], _mm256_loadu_si256(tx + 4 * g + i));
            half[g] = _mm256_mullo_epi32(u, tsc32[g]);
            continue;
          }
#endif
          half[g] = _mm256_madd_epi16(_mm256_maddubs_epi16(t[4 * g], _mm256_loadu_si256(tx + 4 * g)), tsc[g]);
          for (int i = 1; i < 4; ++i)
            half[g] = _mm256_add_epi32(half[g], _mm256_madd_epi16(_mm256_maddubs_epi16(t[4 * g + i], _mm256_loadu_si256(tx + 4 * g + i)), tsc[g]));
        }
        sum = _mm256_add_epi32(_mm256_permute2x128_si256(half[0], half[1], 0x20),
                               _mm256_permute2x128_si256(half[0], half[1], 0x31));
      }
      // lane j = sc[2j] * S[2j] + sc[2j + 1] * S[2j + 1]: one madd of int16 pairs (|.| <= 2 * 128 * 2032)
      const __m256i off = _mm256_madd_epi16(sc_words, s16);
      // exact: |dot| <= 32 * 63 * 127 * 128 + 32 * 32 * 127 * 128
      const __m256i dot = _mm256_sub_epi32(sum, _mm256_slli_epi32(off, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, _mm256_loadu_ps(x.d.data() + xb)), acc[r]);
    }
  }
};

constexpr int kKRows = 16;  // rows per pass over the K-quant rows: the weights leave DRAM once per 16 rows

// Output features [n0, n1) for rows [r0, r0 + rn), rn <= kKRows (R: the count at compile time,
// or 0): out[r * ldo + n]. Feature n's row of super-blocks (<= a few KB) is read once from
// memory and each super-block serves every row.
template <typename Format, int R>
void rows_q8(const kvserve::Q8Act& x, int64_t r0, int rn, const uint8_t* w, int64_t n0, int64_t n1, float* out,
             int64_t ldo) {
  const int nr = R ? R : rn;
  const int64_t nb = x.K / 256;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R ? R : kKRows], corr[R ? R : kKRows];
    for (int r = 0; r < nr; ++r) acc[r] = corr[r] = _mm256_setzero_ps();
    const uint8_t* row = w + n * nb * Format::kBytes;
    for (int64_t sb = 0; sb < nb; ++sb) {
      prefetch_ahead(row + sb * Format::kBytes, Format::kBytes);
      Format::template block<R>(row + sb * Format::kBytes, x, r0, nr, sb, acc, corr);
    }
    for (int r = 0; r < nr; ++r) out[r * ldo + n] = hsum(_mm256_sub_ps(acc[r], corr[r]));
  }
}

template <typename Format>
void rows_q8_all(const kvserve::Q8Act& x, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  for (int64_t r = 0; r < x.M; r += kKRows) {
    float* o = out + r * ldo;
    const int rn = static_cast<int>(std::min<int64_t>(kKRows, x.M - r));
    if (rn == 1)
      rows_q8<Format, 1>(x, r, 1, w, n0, n1, o, ldo);
    else
      rows_q8<Format, 0>(x, r, rn, w, n0, n1, o, ldo);
  }
}

template <int R>
struct Q4_1Kernel {
  static constexpr int kMaxRows = 16;  // 16 accumulators spill, but the strip-block re-lay is shared by more rows
  static void run(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, float* o, int64_t ldo, int64_t cols) {
    strip_q4_1<R>(x, r0, s, o, ldo, cols);  // ymm vpdpbusd measured slower here (see cpu_has_vnni)
  }
  static void run_pair(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, int64_t bytes, float* o, int64_t ldo) {
    pair_q4_1<R>(x, r0, s, bytes, o, ldo);
  }
};
template <int R>
struct Q8_0Kernel {
  static constexpr int kMaxRows = 8;
  static void run(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, float* o, int64_t ldo, int64_t cols) {
    strip_q8_0<R>(x, r0, s, o, ldo, cols);
  }
  static void run_pair(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, int64_t bytes, float* o, int64_t ldo) {
    pair_q8_0<R>(x, r0, s, bytes, o, ldo);
  }
};

// Q8Act::kq from the codes q8: each 256 in transpose_k's order.
void transpose_codes_k(const int8_t* q8, int8_t* kq, int64_t n) {
  for (int64_t o = 0; o < n; o += 256) {
    __m256i v[8], t[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + o + 32 * j));
    transpose_k(v, t);
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(kq + o + 32 * j), t[j]);
  }
}

// One 32-block of kvserve::Q8Act::quantize, vectorized (the same fp32 operations as the scalar
// loop, so the same codes): scale, codes as int8 and int16, the code sums.
inline void quantize_block_avx2(const float* xb, float& d_out, float& s_out, int8_t* q8, int16_t* q16, int16_t* s16) {
  // q16 and s16 may be null (layouts not asked for); the block sum s_out is always made
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  const __m256 idv = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)  // round half to even, as nearbyint in the default rounding mode
    q[i] = _mm256_cvtps_epi32(_mm256_min_ps(
        hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8), bytes);
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1));
  if (q16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16), w0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + 16), w1);
  }
  const auto hsum_i32 = [](__m256i x) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
  };
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t sum0 = hsum_i32(_mm256_madd_epi16(w0, ones)), sum1 = hsum_i32(_mm256_madd_epi16(w1, ones));
  if (s16) s16[0] = static_cast<int16_t>(sum0), s16[1] = static_cast<int16_t>(sum1);  // |.| <= 16 * 127
  d_out = d, s_out = d * static_cast<float>(sum0 + sum1);
}

// Strips [s0, s1): strip s writes columns s * 8 .. of out. Rows go in passes of Kernel::kMaxRows,
// then 8, 4, 2, 1 (each row's result does not depend on the pass it is in). On AVX512-VNNI
// CPUs two adjacent full strips go together (Kernel::run_pair, passes of 8 rows, then 4, 2, 1).
template <template <int> class Kernel>
void strips_q8(const kvserve::Q8Act& x, const uint8_t* w, int64_t strip_bytes, int64_t s0, int64_t s1, int64_t N,
               float* out, int64_t ldo) {
  constexpr int kMax = Kernel<1>::kMaxRows;
  static_assert(kMax == 8 || kMax == 16, "passes of 16 or 8 rows, then halving");
  const bool pairs = cpu_has_vnni();
  for (int64_t s = s0; s < s1;) {
    const uint8_t* strip = w + s * strip_bytes;
    if (pairs && s + 1 < s1 && (s + 2) * kStrip <= N) {
      for (int64_t r = 0; r < x.M;) {
        float* o = out + r * ldo + s * kStrip;
        const int64_t left = x.M - r;
        if (left >= 8) Kernel<8>::run_pair(x, r, strip, strip_bytes, o, ldo), r += 8;
        else if (left >= 4) Kernel<4>::run_pair(x, r, strip, strip_bytes, o, ldo), r += 4;
        else if (left >= 2) Kernel<2>::run_pair(x, r, strip, strip_bytes, o, ldo), r += 2;
        else Kernel<1>::run_pair(x, r, strip, strip_bytes, o, ldo), r += 1;
      }
      s += 2;
      continue;
    }
    const int64_t cols = std::min(kStrip, N - s * kStrip);
    for (int64_t r = 0; r < x.M;) {
      float* o = out + r * ldo + s * kStrip;
      const int64_t left = x.M - r;
      if (kMax == 16 && left >= 16) Kernel<kMax>::run(x, r, strip, o, ldo, cols), r += kMax;
      else if (left >= 8) Kernel<8>::run(x, r, strip, o, ldo, cols), r += 8;
      else if (left >= 4) Kernel<4>::run(x, r, strip, o, ldo, cols), r += 4;
      else if (left >= 2) Kernel<2>::run(x, r, strip, o, ldo, cols), r += 2;
      else Kernel<1>::run(x, r, strip, o, ldo, cols), r += 1;
    }
    ++s;
  }
}

#pragma GCC pop_options
#endif

// x [M, K] fp32, packed strips [ceil(N / 8), ...] -> [M, N] fp32 through int8 activations;
// callers check gguf_q8_supported(format) first (engine/quant.py BlockLinear).
// The arguments of the int8 ops: x [M, K] fp32 and `packed` holding N x K weights of `format`,
// which has an int8 kernel on this CPU.
void check_q8_args(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format) {
  TORCH_CHECK(kvserve::q8_supported(format), "no int8-activation kernel for format ", format, " on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t K = x.size(1);
  const bool strips = format == kQ4_1 || format == kQ8_0;
  const int64_t per = strips ? kBlock : 256;
  const int64_t width = K / per * (format == kQ4_1 ? kQ4_1Bytes : format == kQ8_0 ? kQ8_0Bytes
                                   : format == kQ4_K ? kQ4_KBytes : kQ6_KBytes);
  TORCH_CHECK(N >= 1 && K >= per && K % per == 0 && packed.dim() == 2 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous() && packed.size(0) == (strips ? (N + kStrip - 1) / kStrip : N) &&
                  packed.size(1) == width,
              "packed weights do not hold ", N, " x ", K, " weights of this format");
}

// x [M, K] quantized with the layouts `format`'s kernel reads.
kvserve::Q8Act quantize_for(const at::Tensor& x, int64_t format) {
  const auto xc = x.contiguous();
  kvserve::Q8Act q;
  q.quantize(xc.data_ptr<float>(), x.size(0), x.size(1), kvserve::q8_layouts(format));
  return q;
}

at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format) {
  check_q8_args(x, packed, N, format);
  auto out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
  const kvserve::Q8Act q = quantize_for(x, format);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (format == kQ4_1 || format == kQ8_0) {  // strips of kStrip features
    at::parallel_for(0, packed.size(0), 1, [&](int64_t s0, int64_t s1) {
      kvserve::gguf_linear_q8_range(q, wp, N, format, s0 * kStrip, std::min(N, s1 * kStrip), op + s0 * kStrip, N);
    });
  } else {
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      kvserve::gguf_linear_q8_range(q, wp, N, format, n0, n1, op + n0, N);
    });
  }
  return out;
}

// SiLU(x @ gate^T) * (x @ up^T) -> [M, I], for a gate/up matrix packed as one [2I, K] matrix of
// one format (gate rows first): gguf_linear_q8 on it, then SiLU * up, without the [M, 2I] product.
// Each thread takes kCols features at a time: their gate and up products ([M, kCols] each, in
// L2) feed silu_mul at once, and their weight rows (<= 74 KB for K = 2048 Q4_K) stay in L2
// across the passes over the rows. The products are gguf_linear_q8's, bit for bit.
at::Tensor gguf_swiglu_q8(const at::Tensor& x, const at::Tensor& packed, int64_t I, int64_t format) {
  constexpr int64_t kCols = 64;  // a multiple of kStrip: strip formats' chunks start on a strip
  TORCH_CHECK(I % kStrip == 0, "the gate/up width must be a multiple of ", kStrip, ", got ", I);
  check_q8_args(x, packed, 2 * I, format);
  const int64_t M = x.size(0);
  auto out = at::empty({M, I}, x.options());
  if (M == 0) return out;
  const kvserve::Q8Act q = quantize_for(x, format);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (I + kCols - 1) / kCols, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> gate(M * kCols), up(M * kCols);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * kCols, n1 = std::min(I, n0 + kCols), w = n1 - n0;
      kvserve::gguf_linear_q8_range(q, wp, 2 * I, format, n0, n1, gate.data(), w);
      kvserve::gguf_linear_q8_range(q, wp, 2 * I, format, I + n0, I + n1, up.data(), w);
      for (int64_t r = 0; r < M; ++r) kvserve::silu_mul(gate.data() + r * w, up.data() + r * w, w, op + r * I + n0);
    }
  });
  return out;
}

// The activation quantization alone, for tests: (codes int8 [M, K], scales fp32 [M, K / 32]).
std::tuple<at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kBlock == 0,
              "x must be a 2-D float32 tensor whose width is a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  const auto xc = x.contiguous();
  kvserve::Q8Act q;
  q.quantize(xc.data_ptr<float>(), M, K);
  at::Tensor codes = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, K / kBlock}, x.options());
  std::copy(q.q8.begin(), q.q8.end(), codes.data_ptr<int8_t>());
  std::copy(q.d.begin(), q.d.end(), d.data_ptr<float>());
  return {codes, d};
}

bool gguf_q8_supported(int64_t format) { return kvserve::q8_supported(format); }

// Which instructions the Q4_1 / Q8_0 int8 kernels use here: "vnni", "avx2" or "none".
std::string gguf_q8_isa() {
#ifdef KVSERVE_X86
  if (cpu_has_avx2()) return cpu_has_vnni() ? "vnni" : "avx2";
#endif
  return "none";
}

}  // namespace

void kvserve::Q8Act::quantize(const float* x, int64_t rows, int64_t width, unsigned layouts) {
  M = rows, K = width;
  const int64_t nb = K / kBlock;
  const bool avx2 = cpu_has_avx2();
  q8.resize(M * K), d.resize(M * nb), s.resize(M * nb);
  kq.resize(avx2 && (layouts & kTransposed) && K % 256 == 0 ? M * K : 0);
  q16.resize(layouts & kWide ? M * K : 0);
  sum16.resize(layouts & kSums16 ? M * K / 16 : 0);
  u8.resize(avx2 && (layouts & kOffset) && cpu_has_vnni() ? M * K : 0);
  int16_t* const wide = q16.empty() ? nullptr : q16.data();
  int16_t* const sums = sum16.empty() ? nullptr : sum16.data();
  // rows [r0, r1): each row's layouts depend on that row alone
  const auto rows_range = [&](int64_t r0, int64_t r1) {
#ifdef KVSERVE_X86
    if (avx2) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t o = r * K + b * kBlock;
          quantize_block_avx2(x + o, d[r * nb + b], s[r * nb + b], q8.data() + o, wide ? wide + o : nullptr,
                              sums ? sums + o / 16 : nullptr);
        }
      if (!kq.empty()) transpose_codes_k(q8.data() + r0 * K, kq.data() + r0 * K, (r1 - r0) * K);
      for (int64_t i = r0 * K; i < static_cast<int64_t>(u8.size()) && i < r1 * K; ++i)
        u8[i] = static_cast<uint8_t>(q8[i]) ^ 0x80;  // x + 128
      return;
    }
#endif
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * kBlock;
        float amax = 0.f;
        for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
        const float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
        const int64_t o = r * K + b * kBlock;
        int32_t half[2] = {0, 0};
        for (int k = 0; k < kBlock; ++k) {
          const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[k] * id)));
          q8[o + k] = static_cast<int8_t>(v);
          if (wide) wide[o + k] = static_cast<int16_t>(v);
          half[k / 16] += static_cast<int32_t>(v);
        }
        if (sums) sums[o / 16] = static_cast<int16_t>(half[0]), sums[o / 16 + 1] = static_cast<int16_t>(half[1]);
        d[r * nb + b] = db;
        s[r * nb + b] = db * static_cast<float>(half[0] + half[1]);
      }
  };
  // Prefill-sized inputs on ATen's threads (inside the native layer's OpenMP region, where each
  // thread quantizes its own copy, parallel_for runs inline).
  if (M * K >= (1 << 16))
    at::parallel_for(0, M, 1, rows_range);
  else
    rows_range(0, M);
}

unsigned kvserve::q8_layouts(int64_t format) {
  if (!q8_supported(format)) return 0;
  switch (format) {
    case kQ8_0: return cpu_has_vnni() ? Q8Act::kOffset | Q8Act::kWide : Q8Act::kWide;  // pairs | lone strips
    case kQ4_K: return Q8Act::kTransposed;
    case kQ6_K: return Q8Act::kTransposed | Q8Act::kSums16;
    default: return 0;  // Q4_1: the codes, scales and block sums
  }
}

bool kvserve::q8_supported(int64_t format) {
  return (format == kQ4_1 || format == kQ8_0 || format == kQ4_K || format == kQ6_K) && cpu_has_avx2();
}

void kvserve::gguf_linear_q8_range(const Q8Act& x, const uint8_t* w, int64_t N, int64_t format, int64_t n0,
                                   int64_t n1, float* out, int64_t ldo) {
  if (n1 <= n0 || x.M == 0) return;
  TORCH_CHECK(q8_supported(format), "no int8-activation kernel for format ", format, " on this CPU");
#ifdef KVSERVE_X86
  if (format == kQ4_K) return rows_q8_all<Q4_KRows>(x, w, n0, n1, out - n0, ldo);
  if (format == kQ6_K) return rows_q8_all<Q6_KRows>(x, w, n0, n1, out - n0, ldo);
  const int64_t s0 = n0 / kStrip, s1 = (n1 + kStrip - 1) / kStrip, n_end = std::min(n1, N);
  // strips_q8 writes strip s at out + s * 8: shift out so feature n0 lands at out[0]
  if (format == kQ4_1)
    strips_q8<Q4_1Kernel>(x, w, x.K / kBlock * kQ4_1Bytes, s0, s1, n_end, out - n0, ldo);
  else
    strips_q8<Q8_0Kernel>(x, w, x.K / kBlock * kQ8_0Bytes, s0, s1, n_end, out - n0, ldo);
#endif
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_q8_supported(int format) -> bool", &gguf_q8_supported);
  m.def("gguf_q8_isa() -> str", &gguf_q8_isa);
  m.def("gguf_linear_q8(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
  m.def("gguf_swiglu_q8(Tensor x, Tensor packed, int intermediate, int format) -> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_linear_q8", &gguf_linear_q8);
  m.impl("gguf_swiglu_q8", &gguf_swiglu_q8);
  m.impl("quantize_q8", &quantize_q8);
}
