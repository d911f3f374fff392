// Block matmuls on int8 activations (ModelConfig.activation_quant "int8"): y[M, N] = x[M, K] @ W^T
// with x quantized per 32-element block (kvserve::Q8Act, llama.cpp's Q8_0/Q8_1 activations) for
// Q4_1 / Q5_0 / Q8_0 weights and per 256 (llama.cpp's Q8_K) for Q4_K / Q6_K, and W the
// strip-packed Q4_1 / Q5_0 / Q8_0 blocks or the GGUF rows of Q4_K / Q6_K that quant_linear.cpp
// reads, as they are (the same bytes the fp32 kernel reads; no second copy). Q4_0 / Q5_1 / Q5_K
// run row kernels on their GGUF rows (below). CPUs without AVX2 have no int8 kernel here
// (q8_supported): callers multiply fp32 activations.
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
//   Q4_1 (160 bytes): d[8], m[8] fp16, then 4 chunks of 32 bytes of nibbles whose low nibbles
//     are k-quad 2o of the 8 columns and high nibbles k-quad 2o + 1, one dword a column (see
//     block_codes.h). Once per strip-block (shared by every row of the pass) one mask or shift
//     gives the 8 vectors w[g] whose dword c is column c's 4 codes at k = 4g .. 4g + 3; a row
//     then multiplies w[g] by its 4 codes at k-quad g broadcast to every dword (maddubs: 16 int16
//     lanes = 8 columns x 2 k pairs), sums the 8 quads in int16 (<= 8 * 2 * 15 * 127 = 30480, no
//     saturation) and one madd by 1 gives the 8 int32 column sums. A row reads its own 32 int8
//     codes per block (an earlier layout broadcast 256 bytes of pre-expanded code pairs per row and
//     block, which at 8+ rows spilled from L1 and made the kernel L2 bound: 16 rows ran ~20% slower).
//   Q5_0 (176 bytes): d[8] fp16, Q4_1's chunks of nibbles, then 32 bytes of fifth bits (see
//     quant_linear.cpp's Q5_0), OR-ed in as the codes are re-laid; w = d (q - 16) is Q4_1's
//     d q + m with m = -16 d, and with 5-bit codes 4 quads are summed in int16, not 8. (Until
//     issue 39 the loader converted Q5_0 matrices to Q8_0 strips, 1.55x their bytes: SmolLM2
//     Q4_K_M's are 52% of the file.)
//   Q8_0 (272 bytes): d[8] fp16, then 8 k-quads of 32 bytes, one dword a column: signed by
//     signed, so on AVX2 maddubs takes |w| and the row's codes with w's sign (strip_q8_0), and
//     vpdpbusd the row's codes offset by 128 (pair_q8_0).
// Many rows: each strip-block is unpacked once and dotted with up to 16 (Q4_1, Q5_0) or 8 (Q8_0) rows;
// on AVX2 CPUs without VNNI, prefill-sized calls run Q4_1 / Q5_0 strips in pairs (pair8_nibbles).
// (The K-quants' many-row kernels are below: pair_rows, lanes_q8 in zmm or ymm lanes.) On AMX CPUs, from 32 rows
// (kAmxStripMinRows), the whole 16-row tiles of the strip pairs take tile products instead (quant_linear_amx.cpp strip_pairs_amx), with
// the same results.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "block_codes.h"
#include "cpu_features.h"  // KVSERVE_X86, cpu_has_avx2, detect_vnni, cpu_has_amx
#include "quant_linear.h"
#include "vec_math.h"      // hsum8, silu_mul

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace {

constexpr int64_t kBlock = 32;
using namespace kvserve::blocks;  // the BlockFormat codes, strip and K-quant super-block sizes (block_codes.h)
constexpr int64_t kStrip = kStripColumns;
constexpr int64_t kQ4_1Bytes = kQ4_1StripBytes, kQ8_0Bytes = kQ8_0StripBytes, kQ5_0Bytes = kQ5_0StripBytes;  // strip-blocks
constexpr int64_t kQ4_0Bytes = 18, kQ5_1Bytes = 24;  // GGUF blocks of 32 weights

// The weights along K and the bytes of one block of `format` as the int8 kernels read it.
constexpr int64_t block_weights(int64_t format) { return format == kQ4_K || format == kQ5_K || format == kQ6_K ? 256 : 32; }
constexpr int64_t block_bytes(int64_t format) {
  return format == kQ4_1 ? kQ4_1Bytes : format == kQ8_0 ? kQ8_0Bytes : format == kQ4_0 ? kQ4_0Bytes
       : format == kQ4_K ? kQ4_KBytes : format == kQ5_K ? kQ5_KBytes : format == kQ6_K ? kQ6_KBytes
       : format == kQ5_0 ? kQ5_0Bytes : kQ5_1Bytes;
}

using kvserve::k8_order;  // quant_linear.h

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
using kvserve::u32_at;  // block_codes.h

// Rows [r, M) in passes of the largest row count of R, Smaller... (descending, the last 1) that
// still fits: pass(std::integral_constant<int, n>{}, r0) for each pass of n rows from r0. The
// kernels take their row count at compile time (the accumulators are registers).
template <int R, int... Smaller, typename Pass>
inline void row_passes(int64_t r, int64_t M, Pass&& pass) {
  static_assert(sizeof...(Smaller) > 0 || R == 1, "the last pass is one row");
  for (; M - r >= R; r += R) pass(std::integral_constant<int, R>{}, r);
  if constexpr (sizeof...(Smaller) > 0) row_passes<Smaller...>(r, M, pass);
}

using kvserve::cpu_has_avx2;  // cpu_features.h: one CPU check for every source

#ifdef KVSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

using kvserve::prefetch_ahead;  // quant_linear.h
using kvserve::prefetch_range;

// Cache lines to prefetch into L2 while a kernel computes: the lines holding [p, p + bytes), dealt
// out over `steps` steps of its loop, a few at each (step(i) for i < steps, in any order).
struct LineSpan {
  const uint8_t* first = nullptr;  // the line holding p
  int64_t lines = 0, per_step = 0;
  LineSpan() = default;
  LineSpan(const uint8_t* p, int64_t bytes, int64_t steps)
      : first(reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63})),
        lines(bytes > 0 ? (reinterpret_cast<uintptr_t>(p + bytes - 1) >> 6) - (reinterpret_cast<uintptr_t>(p) >> 6) + 1 : 0),
        per_step((lines + steps - 1) / steps) {}
  void step(int64_t i) const {
    for (int64_t l = i * per_step, end = std::min(lines, l + per_step); l < end; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(first + 64 * l), _MM_HINT_T1);
  }
};

inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store_cols(__m256 v, float* out, int64_t cols) {
  if (cols == kStrip) {
    _mm256_storeu_ps(out, v);
  } else {
    alignas(32) float tmp[kStrip];
    _mm256_store_ps(tmp, v);
    std::copy(tmp, tmp + cols, out);
  }
}

// A Q4_1 or Q5_0 (kQ5) strip-block's codes as k-quads: dword c of w[j] = column c's codes at
// k = 4j .. 4j + 3 (unsigned, 0..15, Q5_0 0..31), block_codes.h nibble_quads.
template <bool kQ5>
inline void relay_nibbles(const uint8_t* sb, __m256i* w) {
  for (int o = 0; o < 4; ++o) kvserve::nibble_quads<kQ5>(sb + (kQ5 ? 16 : 32), sb + 144, o, w[2 * o], w[2 * o + 1]);
}

// Row code quad j (k = 4j .. 4j + 3) of a block's 32 int8 codes, broadcast to every dword.
inline __m256i quad_at(const int8_t* xq, int j) {
  int32_t v;
  std::memcpy(&v, xq + 4 * j, 4);
  return _mm256_set1_epi32(v);
}

// Rows [r0, r0 + R) against one Q4_1 or Q5_0 (kQ5) strip. Each strip-block is re-laid once into
// k-quads and every row then needs only broadcasts of its own codes, 4 at a time (32 bytes a
// block, from L1). Q5_0's w = d (q - 16) is Q4_1's d q + m with m = -16 d (exact in fp32). Its
// 5-bit codes sum 4 quads in int16 (<= 4 * 2 * 31 * 127 = 31496), Q4_1's all 8 (<= 30480).
template <bool kQ5, int R>
void strip_nibbles(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, float* out, int64_t ldo, int64_t cols) {
  constexpr int64_t kBytes = strip_block_bytes(kQ5 ? kQ5_0 : kQ4_1);
  const int64_t nb = x.K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb = strip + b * kBytes;
    prefetch_ahead(sb, kBytes);
    __m256i w[8];
    relay_nibbles<kQ5>(sb, w);
    const __m256 d = halves8(sb), m = kQ5 ? _mm256_mul_ps(d, _mm256_set1_ps(-16.f)) : halves8(sb + 16);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      const int8_t* xq = x.q8.data() + rb * kBlock;
      const auto quads = [&](int j0, int j1) {
        __m256i s = _mm256_maddubs_epi16(w[j0], quad_at(xq, j0));
        for (int j = j0 + 1; j < j1; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], quad_at(xq, j)));
        return _mm256_madd_epi16(s, ones);
      };
      const __m256 dot = _mm256_cvtepi32_ps(kQ5 ? _mm256_add_epi32(quads(0, 4), quads(4, 8)) : quads(0, 8));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.d[rb])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_cols(acc[r], out + r * ldo, cols);
}

// ---- Strip pairs in ymm (AVX2 CPUs without VNNI, prefill-sized calls: kPair8MinRows): two
// adjacent full Q4_1 or Q5_0 strips (16 columns) share each broadcast row quad, as the K-quants'
// two lane groups do (lane8_rows): per row and k-quad one broadcast feeds two maddubs, where
// strip_nibbles' one feeds one. The pair is re-laid once per call (relay_strip_pair8: per strip-block
// strip a's 8 k-quads, strip b's 8, then d and m of both as fp32, 640 bytes) and the rows go 4 at
// a time. Per row and column the integers (Q4_1's 8 quads, Q5_0's two runs of 4, summed in int16;
// madd by 1) and the fp32 operations (fmadd by d dx, then by m s, block by block) are
// strip_nibbles' own, so every output is the same float.
struct StripPair8 {
  __m256i q[2][8];  // strip g's k-quad j
  __m256 d[2], m[2];
};

template <bool kQ5>
void relay_strip_pair8(const uint8_t* strip, int64_t strip_bytes, int64_t nb, std::vector<StripPair8>& out) {
  constexpr int64_t kBytes = strip_block_bytes(kQ5 ? kQ5_0 : kQ4_1);
  out.resize(nb);
  for (int64_t b = 0; b < nb; ++b)
    for (int g = 0; g < 2; ++g) {
      const uint8_t* sb = strip + g * strip_bytes + b * kBytes;
      prefetch_ahead(sb, kBytes);
      relay_nibbles<kQ5>(sb, out[b].q[g]);
      out[b].d[g] = halves8(sb);
      out[b].m[g] = kQ5 ? _mm256_mul_ps(out[b].d[g], _mm256_set1_ps(-16.f)) : halves8(sb + 16);
    }
}

template <bool kQ5, int R>
void pair8_nibbles(const kvserve::Q8Act& x, int64_t r0, const StripPair8* blocks, float* out, int64_t ldo) {
  const int64_t nb = x.K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  // the sums kept across blocks (and Q5_0's first 4 quads' int32 sums) in memory, laundered as
  // in lane8_rows: the 8 int16 sums, two weight vectors and the broadcast then fit the 16 ymm registers
  alignas(32) __m256 acc_at[2][R];
  alignas(32) __m256i half_at[2][R];
  __m256 (*acc)[R] = acc_at;
  __m256i (*half)[R] = half_at;
  asm("" : "+r"(acc), "+r"(half));
  for (int g = 0; g < 2; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_ps();
  // Q4_1's codes sum all 8 quads in int16, Q5_0's 5-bit codes 4 (strip_nibbles' bounds)
  constexpr int kRun = kQ5 ? 4 : 8;
  for (int64_t b = 0; b < nb; ++b) {
    const StripPair8& P = blocks[b];
    const int8_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q8.data() + ((r0 + r) * nb + b) * kBlock;
    __m256i I[2][R];
    for (int j0 = 0; j0 < 8; j0 += kRun) {
      for (int r = 0; r < R; ++r) {
        const __m256i bq = quad_at(xq[r], j0);
        for (int g = 0; g < 2; ++g) I[g][r] = _mm256_maddubs_epi16(P.q[g][j0], bq);
      }
#pragma GCC unroll 8
      for (int j = j0 + 1; j < j0 + kRun; ++j) {
        const __m256i w0 = P.q[0][j], w1 = P.q[1][j];
        for (int r = 0; r < R; ++r) {
          const __m256i bq = quad_at(xq[r], j);
          I[0][r] = _mm256_add_epi16(I[0][r], _mm256_maddubs_epi16(w0, bq));
          I[1][r] = _mm256_add_epi16(I[1][r], _mm256_maddubs_epi16(w1, bq));
          asm("" : "+x"(I[0][r]), "+x"(I[1][r]));  // keeps the sums chains (see lane8_rows)
        }
      }
      if (kQ5 && j0 == 0)
        for (int g = 0; g < 2; ++g)
          for (int r = 0; r < R; ++r) half[g][r] = _mm256_madd_epi16(I[g][r], ones);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      const __m256 dx = _mm256_set1_ps(x.d[rb]), sx = _mm256_set1_ps(x.s[rb]);
      for (int g = 0; g < 2; ++g) {
        const __m256i sum = _mm256_madd_epi16(I[g][r], ones);
        const __m256 dot = _mm256_cvtepi32_ps(kQ5 ? _mm256_add_epi32(half[g][r], sum) : sum);
        acc[g][r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(P.d[g], dx), acc[g][r]);
        acc[g][r] = _mm256_fmadd_ps(P.m[g], sx, acc[g][r]);
      }
    }
  }
  for (int g = 0; g < 2; ++g)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + kStrip * g, acc[g][r]);
}

// Rows [r0, r0 + R) against one Q8_0 strip: signed by signed bytes through maddubs's unsigned
// operand, |w| against x with w's sign (sign_epi8; |w| <= 128 and |x| <= 127, so a pair's sum
// <= 32512 does not saturate), then madd by 1 to each column's int32 sum of its quad.
template <int R>
void strip_q8_0(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, float* out, int64_t ldo, int64_t cols) {
  const int64_t nb = x.K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb = strip + b * kQ8_0Bytes;
    prefetch_ahead(sb, kQ8_0Bytes);
    __m256i w[8], aw[8];
    for (int j = 0; j < 8; ++j) {
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * j));
      aw[j] = _mm256_sign_epi8(w[j], w[j]);
    }
    const __m256 d = halves8(sb);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      const int8_t* xq = x.q8.data() + rb * kBlock;
      __m256i s = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(quad_at(xq, j), w[j])), ones));
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
// Likewise the K-quants' one-row kernels take 512-bit registers (two 32-blocks per instruction).
#if defined(KVSERVE_VNNI_BUILD) && defined(__AVX512BW__)
#define KVSERVE_ZMM_ROWS 1
#endif

const bool kHasVnni = kvserve::detect_vnni();  // once, at load: the kernels test it per block (a call would spill their registers)
inline bool cpu_has_vnni() { return kHasVnni; }

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")

// ---- Strip pairs in 512-bit registers (AVX512-VNNI CPUs): two adjacent full strips are 16
// columns, one zmm; the same integer dot products and the same fp32 operations per column as the
// AVX2 kernels, so every output is the same float. On Zen 5 (full-width AVX-512) one thread, 16
// rows of 1536 x 576 Q4_1: ~90 (AVX2 maddubs) -> ~145 GMAC/s; 512 rows ~190 (dense fp32 oneDNN
// ~100). Rows go in groups of 8: each k-quad's vpdpbusd then feeds 8 independent accumulators.

using kvserve::relay_q4_1_pair;  // block_codes.h
using kvserve::relay_q5_0_pair;
using kvserve::relay_q8_0_pair;
using kvserve::halves16;

inline __m512i quad_at16(const int8_t* xq, int j) {
  int32_t v;
  std::memcpy(&v, xq + 4 * j, 4);
  return _mm512_set1_epi32(v);
}

// Rows [r0, r0 + R) against strips a and a + strip_bytes (Q4_1, or Q5_0: kQ5, m = -16 d):
// unsigned codes by the row's signed codes, vpdpbusd as it is.
// kRelaid: the blocks' re-laid weights are at relaid (relay_all), else re-laid here.
template <bool kQ5, bool kRelaid, int R>
void pair_nibbles(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, int64_t strip_bytes, float* out,
                  int64_t ldo, const uint8_t* relaid) {
  static_assert(R <= 8, "one group of accumulators");
  constexpr int64_t kBytes = strip_block_bytes(kQ5 ? kQ5_0 : kQ4_1);
  const int64_t nb = x.K / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *sa = strip + b * kBytes, *sb = sa + strip_bytes;
    __m512i w[8];
    if constexpr (kRelaid) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(relaid + 64 * (8 * b + j));
    } else {
      prefetch_ahead(sa, kBytes), prefetch_ahead(sb, kBytes);
      if (kQ5) relay_q5_0_pair(sa, sb, w); else relay_q4_1_pair(sa, sb, w);
    }
    const __m512 d = halves16(sa, sb), m = kQ5 ? _mm512_mul_ps(d, _mm512_set1_ps(-16.f)) : halves16(sa + 16, sb + 16);
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
// come off: sum (x + 128) w - 128 sum w = sum x w, exact in int32. The strips hold their codes in
// k-quads already, so every pass loads them as they are (no relay_all).
template <int R>
void pair_q8_0(const kvserve::Q8Act& x, int64_t r0, const uint8_t* strip, int64_t strip_bytes, float* out,
               int64_t ldo) {
  static_assert(R <= 8, "one group of accumulators");
  const int64_t nb = x.K / kBlock;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *sa = strip + b * kQ8_0Bytes, *sb = sa + strip_bytes;
    __m512i w[8], sum128 = _mm512_setzero_si512();
    prefetch_ahead(sa, kQ8_0Bytes), prefetch_ahead(sb, kQ8_0Bytes);
    relay_q8_0_pair(sa, sb, w);
    for (int j = 0; j < 8; ++j) sum128 = _mm512_dpbusd_epi32(sum128, bias, w[j]);
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

// A nibble strip pair's every block re-laid (relay(a, b, w): 8 zmm a block) into `out` (64 bytes a zmm,
// stored and loaded unaligned: the buffer is plain bytes, whatever the build's vector alignment),
// for passes over more rows than one pass takes: each then loads them (from L1: 9 KB for K = 576)
// instead of re-laying its own copy, which for the nibble formats' 8-row passes was ~1/4 of the work.
template <typename Relay>
void relay_all(const uint8_t* strip, int64_t strip_bytes, int64_t block_bytes, int64_t nb, Relay&& relay,
               std::vector<uint8_t>& out) {
  out.resize(nb * 8 * 64);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sa = strip + b * block_bytes;
    prefetch_ahead(sa, block_bytes), prefetch_ahead(sa + strip_bytes, block_bytes);
    __m512i w[8];
    relay(sa, sa + strip_bytes, w);
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(out.data() + 64 * (8 * b + j), w[j]);
  }
}

#pragma GCC pop_options

// ---- K-quant row formats (GGUF rows as stored, super-blocks of 256 along K) against the activations
// per 256 (Q8Act kSuper: one scale dx per super-block, llama.cpp's Q8_K). Per output feature,
// row and super-block the weights' sub-block scales multiply the integer dot products in
// integers, so one exact int32 (two for Q4_K) per super-block reaches fp32:
//   Q4_K, Q5_K (5-bit q): w = (d sc_j) q - (dmin m_j), sub-blocks j of 32, I_j the codes' dot
//         product and S_j the activation codes' sum: A = sum_j sc_j I_j, B = sum_j m_j S_j;
//         acc += A (d dx), corr += B (dmin dx).
//   Q6_K: w = (d sc_i) (q - 32), sub-blocks i of 16: A = sum_i sc_i (I_i - 32 S_i); acc += A (d dx).
// Exact: |A| <= 8 * 63 * 32 * 31 * 127 (Q4_K, Q5_K) and 16 * 128 * 16 * 63 * 127 (Q6_K), all < 2^31.
// A row's acc (lane 0) and corr (lane 1) are one __m128, added to in super-block order by one
// fmadd of [A, B] and [d dx, dmin dx], so the one-row and the many-row paths, which reach A and B
// by different integer routes, give the same floats, and a row's result does not depend on the
// other rows of its pass. The result is acc - corr.
// (Per-32 activations, an earlier version, needed 8 float scales per super-block and so an
// 8-way horizontal reduction per row and super-block: the one-row Q4_K kernel was compute bound
// at ~22 GB/s per thread.)

using kvserve::hsum8;  // vec_math.h

// The sums of a's and of b's lanes, exact, as int32 lanes 0 and 1.
inline __m128i hsum2_epi32(__m256i a, __m256i b) {
  const __m128i sa = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  const __m128i sb = _mm_add_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  const __m128i t = _mm_add_epi32(_mm_unpacklo_epi64(sa, sb), _mm_unpackhi_epi64(sa, sb));
  return _mm_hadd_epi32(t, t);
}

#ifdef KVSERVE_ZMM_ROWS
// int16 lanes 0-7 = a, 8-15 = b, 16-23 = c, 24-31 = d (vpermw indices, vpsrlvw counts).
inline __m512i four_quarters(int a, int b, int c, int d) {
  const auto two = [](int v) { return v | (v << 16); };
  return _mm512_setr_epi32(two(a), two(a), two(a), two(a), two(b), two(b), two(b), two(b), two(c), two(c), two(c),
                           two(c), two(d), two(d), two(d), two(d));
}
// int16 lanes 0-15 = a (the low 256 bits), 16-31 = b.
inline __m512i two_halves(int a, int b) { return four_quarters(a, a, b, b); }
#endif

// The 8 32-byte blocks v[j] of a super-block as 4-byte groups v[j].t (k = 32 j + 4 t .. + 3)
// -> out[4 g + i] = [v[4g].i v[4g+1].i v[4g+2].i v[4g+3].i | the same at t = i + 4]: a dword
// lane m then holds block j = 4 g + m % 4 (Q8Act::kq is the activations in this order).
inline void transpose_k(const __m256i* v, __m256i* out) {
  for (int g = 0; g < 2; ++g) {
    const __m256i* w = v + 4 * g;
    const __m256i a0 = _mm256_unpacklo_epi32(w[0], w[1]), a1 = _mm256_unpackhi_epi32(w[0], w[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(w[2], w[3]), a3 = _mm256_unpackhi_epi32(w[2], w[3]);
    out[4 * g] = _mm256_unpacklo_epi64(a0, a2), out[4 * g + 1] = _mm256_unpackhi_epi64(a0, a2);
    out[4 * g + 2] = _mm256_unpacklo_epi64(a1, a3), out[4 * g + 3] = _mm256_unpackhi_epi64(a1, a3);
  }
}

// Per dword lane m of a transposed half g (transpose_k), the int16 pair or int32 of block 4g + m % 4's
// value in v (8 bytes, one per block): words[g] as int16 lane pairs, dwords[g] as int32.
inline void per_transposed_lane(__m128i v8, __m256i* words, __m256i* dwords) {
  for (int g = 0; g < 2; ++g) {
    const char a = static_cast<char>(4 * g);
    const __m128i b = _mm_shuffle_epi8(v8, _mm_setr_epi8(a, a + 1, a + 2, a + 3, a, a + 1, a + 2, a + 3, -1, -1, -1,
                                                          -1, -1, -1, -1, -1));
    dwords[g] = _mm256_cvtepi8_epi32(b);
    words[g] = _mm256_or_si256(dwords[g], _mm256_slli_epi32(dwords[g], 16));
  }
}

using kvserve::q4_k_scales;  // block_codes.h

#ifdef KVSERVE_ZMM_ROWS
// One row against one super-block at b through Rows::one_row (KRows, Q6_KRows; VNNI CPUs): acc[0] +=
// float([A, B]) * scale * the row's activation scale, scale = [d, dmin] (Q6_K: [d, 0], its B zero).
// The one-feature pass of both formats: the remainder of quad_row's features.
template <typename Rows>
__attribute__((always_inline)) inline void one_row_block(const uint8_t* b, const kvserve::Q8Act& x, int64_t r0,
                                                         int64_t sb, __m128 scale, __m128* acc) {
  const int64_t nbk = x.K / 256;
  const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ksum16.data() + (r0 * nbk + sb) * 16));
  __m256i a, side;
  Rows::one_row(b, x.k8.data() + r0 * x.K + 256 * sb, s16, a, side);
  const __m128 ab = _mm_cvtepi32_ps(hsum2_epi32(a, side));
  acc[0] = _mm_fmadd_ps(ab, _mm_mul_ps(scale, _mm_set1_ps(x.kd[r0 * nbk + sb])), acc[0]);
}
#endif

// One super-block against rows [r0, r0 + R) (R = 0: rn rows, a run-time count): the codes and
// scales are unpacked once and every row is dotted from registers, so a pass over the weights
// serves up to kKRows rows. acc[r]: row r's [acc, corr] (see above).
// Inlined by force (here and in Q6_KRows): GCC had left it a call per super-block, so a one-row
// pass kept acc in memory, a store and reload in every super-block's chain, and reloaded its
// constants; inlined, one thread's one-row Q4_K / Q6_K pass (2048-wide rows, in L2) ran 10% / 12%
// faster and the 1B Q4_K_M's one-row decode step 7-12% (docs/benchmarks.md, "a twentieth session").
// Q4_K and Q5_K (kQ5): the same scales and mins, Q5_K's codes with a fifth bit, bit j of qh[32]
// for sub-block j (|pair| <= 2 * 31 * 127; 4 summed in int16 <= 31496).
template <bool kQ5>
struct KRows {
  static constexpr int64_t kCode = kQ5 ? kQ5_K : kQ4_K, kBytes = kQ5 ? kQ5_KBytes : kQ4_KBytes;
  static constexpr int64_t kCodes = kQ5 ? 48 : 16;  // the nibbles' offset (Q5_K: after qh)
  // [d, dmin]: the fp16 pair the floats scale A and B by
  static inline uint32_t scales(const uint8_t* b) { return u32_at(b); }
#ifdef KVSERVE_ZMM_ROWS
  // One row against the super-block at b (VNNI CPUs): a's lanes sum to A = sum_j sc_j I_j, side's
  // to B = sum_j m_j S_j (s16: the row's 16-code sums; xk its codes in k8_order). Two blocks per
  // instruction: 64 code bytes are blocks [4c | 4c + 2] (low nibbles) and [4c + 1 | 4c + 3]
  // (high), which is k8_order; vpermw puts each block's scale in its half. vpdpwssd scales the
  // maddubs pairs and adds them in one instruction (madd then add before: the same integers; one
  // thread's one-row Q4_K / Q6_K pass 10-15% / 6-10% fewer ticks).
  __attribute__((always_inline)) static inline void one_row(const uint8_t* b, const int8_t* xk, __m256i s16, __m256i& a,
                                                            __m256i& side) {
    const __m128i sm = q4_k_scales(b);  // bytes 0-7 the scales, 8-15 the mins
    side = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm)), s16);
    const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sm));
    const __m512i m15 = _mm512_set1_epi8(15);
    __m512i a16 = _mm512_setzero_si512();
    const __m512i pick[4] = {two_halves(0, 2), two_halves(1, 3), two_halves(4, 6), two_halves(5, 7)};
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
    for (int c = 0; c < 2; ++c) {
      const __m512i v = _mm512_loadu_si512(b + kCodes + 64 * c);
      __m512i lo = _mm512_and_si512(v, m15), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
      if (kQ5) {  // blocks [4c | 4c + 2] and [4c + 1 | 4c + 3]: their bits of qh, shifted per half
        const __m512i one = _mm512_set1_epi8(1);
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, pick[2 * c]), one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, pick[2 * c + 1]), one), 4));
      }
      const __m512i slo = _mm512_permutexvar_epi16(pick[2 * c], sc), shi = _mm512_permutexvar_epi16(pick[2 * c + 1], sc);
      a16 = _mm512_dpwssd_epi32(a16, _mm512_maddubs_epi16(lo, _mm512_loadu_si512(xk + 128 * c)), slo);
      a16 = _mm512_dpwssd_epi32(a16, _mm512_maddubs_epi16(hi, _mm512_loadu_si512(xk + 128 * c + 64)), shi);
    }
    a = _mm256_add_epi32(_mm512_castsi512_si256(a16), _mm512_extracti64x4_epi64(a16, 1));
  }
#endif
  template <int R>
  __attribute__((always_inline)) static inline void block(const uint8_t* b, const kvserve::Q8Act& x, int64_t r0, int rn, int64_t sb, __m128* acc) {
    const int nr = R ? R : rn;
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(scales(b))));  // [d, dmin, 0, 0]
    const int64_t nbk = x.K / 256;
#ifdef KVSERVE_ZMM_ROWS
    if (R == 1 && cpu_has_vnni()) {  // the remainder of quad_row's features
      one_row_block<KRows>(b, x, r0, sb, dd, acc);
      return;
    }
#endif
    const __m128i sm = q4_k_scales(b);  // bytes 0-7 the scales, 8-15 the mins
    // the mins as int16, each twice: lane i pairs with the activations' sum of 16 codes i
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    __m256i q[8];  // the codes of block j (AVX2 paths)
    const auto unpack = [&] {
      const __m256i mask = _mm256_set1_epi8(15);
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kCodes + 32 * c));
        q[2 * c] = _mm256_and_si256(v, mask);
        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
      if (kQ5) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)), one = _mm256_set1_epi8(1);
        for (int j = 0; j < 8; ++j)  // per 16-bit lane: bit j of each byte to bit 4
          q[j] = _mm256_or_si256(q[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4));
      }
    };
    if (R == 1) {
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ksum16.data() + (r0 * nbk + sb) * 16));
      const int8_t* xk = x.k8.data() + r0 * x.K + 256 * sb;  // blocks in k8_order
      __m256i a;  // lanes in any order: only their sum A is used
      {  // maddubs, then the scale of block j in every int16 lane (madd)
        unpack();
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        a = _mm256_setzero_si256();  // |lane| <= 8 * 2 * 2 * 15 * 127 * 63
        for (int j = 0; j < 8; ++j) {
          const __m256i scj = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<short>((2 * j) | ((2 * j + 1) << 8))));
          const __m256i xj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk + 32 * k8_order(j)));
          a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], xj), scj));
        }
      }
      const __m128 ab = _mm_cvtepi32_ps(hsum2_epi32(a, _mm256_madd_epi16(mins, s16)));
      acc[0] = _mm_fmadd_ps(ab, _mm_mul_ps(dd, _mm_set1_ps(x.kd[r0 * nbk + sb])), acc[0]);
      return;
    }
    // many rows: transpose the codes once (transpose_k), so that with Q8Act::kq each row's dot
    // products are vertical adds, each dword lane within one block j and scaled by its sc_j
    __m256i t[8], tsc[2], tsc32[2];
    unpack();
    transpose_k(q, t);
    per_transposed_lane(sm, tsc, tsc32);
    const bool vnni = cpu_has_vnni();
    for (int r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      const __m256i* xq = reinterpret_cast<const __m256i*>(x.kq.data() + row * x.K + 256 * sb);
      __m256i a = _mm256_setzero_si256();
      for (int g = 0; g < 2; ++g) {
#ifdef KVSERVE_VNNI_BUILD
        if (vnni) {  // the same integers, 4 products per int32 lane per instruction (two short chains)
          const __m256i* xg = xq + 4 * g;
          const __m256i u = _mm256_dpbusd_epi32(_mm256_setzero_si256(), t[4 * g], _mm256_loadu_si256(xg));
          const __m256i v = _mm256_dpbusd_epi32(_mm256_setzero_si256(), t[4 * g + 2], _mm256_loadu_si256(xg + 2));
          const __m256i i = _mm256_add_epi32(_mm256_dpbusd_epi32(u, t[4 * g + 1], _mm256_loadu_si256(xg + 1)),
                                             _mm256_dpbusd_epi32(v, t[4 * g + 3], _mm256_loadu_si256(xg + 3)));
          a = _mm256_add_epi32(a, _mm256_mullo_epi32(i, tsc32[g]));
          continue;
        }
#endif
        __m256i u = _mm256_maddubs_epi16(t[4 * g], _mm256_loadu_si256(xq + 4 * g));
        for (int i = 1; i < 4; ++i)  // |.| <= 4 * 2 * 31 * 127
          u = _mm256_add_epi16(u, _mm256_maddubs_epi16(t[4 * g + i], _mm256_loadu_si256(xq + 4 * g + i)));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(u, tsc[g]));
      }
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ksum16.data() + (row * nbk + sb) * 16));
      const __m128 ab = _mm_cvtepi32_ps(hsum2_epi32(a, _mm256_madd_epi16(mins, s16)));
      acc[r] = _mm_fmadd_ps(ab, _mm_mul_ps(dd, _mm_set1_ps(x.kd[row * nbk + sb])), acc[r]);
    }
  }
};

using Q4_KRows = KRows<false>;
using Q5_KRows = KRows<true>;

struct Q6_KRows {
  static constexpr int64_t kCode = kQ6_K;
  static constexpr int64_t kBytes = kQ6_KBytes;
  // [d, 0]: the fp16 pair the floats scale A (and a zero B) by
  static inline uint32_t scales(const uint8_t* b) { return u16_at(b + 208); }
#ifdef KVSERVE_ZMM_ROWS
  // One row against the super-block at b (VNNI CPUs), as KRows::one_row: a's lanes sum to
  // A = sum_i sc_i (I_i - 32 S_i) (s16: the row's 16-code sums), side is zero (no mins). Two
  // blocks per instruction, in k8_order: [4h | 4h + 2] from the low/high nibbles of ql's first 32
  // bytes, [4h + 1 | 4h + 3] of its next 32 (shifted per 256-bit half by vpsrlvw); vpermw puts
  // each 16 weights' scale in their int16 lanes.
  __attribute__((always_inline)) static inline void one_row(const uint8_t* b, const int8_t* xk, __m256i s16, __m256i& a,
                                                            __m256i& side) {
    const __m256i sc_words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    const __m512i sh04 = two_halves(0, 4), sh26 = two_halves(2, 6);
    const __m512i scw = _mm512_castsi256_si512(sc_words);
    __m512i a16 = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const auto both = [&](const uint8_t* p) {
        return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      };
      const __m512i l0 = both(b + 64 * h), l1 = both(b + 64 * h + 32), qh = both(b + 128 + 32 * h);
      const auto codes = [&](__m512i l, __m512i qh_shift) {
        const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(qh, qh_shift), m2);
        return _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(l, sh04), m4), _mm512_slli_epi16(high, 4));
      };
      const int s = 8 * h;  // block 4h + g's scales: sc[s + 2g], sc[s + 2g + 1]
      const __m512i sa = _mm512_permutexvar_epi16(four_quarters(s, s + 1, s + 4, s + 5), scw);
      const __m512i sb2 = _mm512_permutexvar_epi16(four_quarters(s + 2, s + 3, s + 6, s + 7), scw);
      a16 = _mm512_dpwssd_epi32(a16, _mm512_maddubs_epi16(codes(l0, sh04), _mm512_loadu_si512(xk + 128 * h)), sa);
      a16 = _mm512_dpwssd_epi32(a16, _mm512_maddubs_epi16(codes(l1, sh26), _mm512_loadu_si512(xk + 128 * h + 64)), sb2);
    }
    const __m256i off = _mm256_madd_epi16(sc_words, s16);  // |.| <= 2 * 128 * 2032
    a = _mm256_sub_epi32(_mm256_add_epi32(_mm512_castsi512_si256(a16), _mm512_extracti64x4_epi64(a16, 1)),
                         _mm256_slli_epi32(off, 5));
    side = _mm256_setzero_si256();
  }
#endif
  template <int R>
  __attribute__((always_inline)) static inline void block(const uint8_t* b, const kvserve::Q8Act& x, int64_t r0, int rn, int64_t sb, __m128* acc) {
    const int nr = R ? R : rn;
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(scales(b))));  // [d, 0, 0, 0]
    const int64_t nbk = x.K / 256;
#ifdef KVSERVE_ZMM_ROWS
    if (R == 1 && cpu_has_vnni()) {  // the remainder of quad_row's features
      one_row_block<Q6_KRows>(b, x, r0, sb, d, acc);
      return;
    }
#endif
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    // the 16 scales as int16, for the -32 offset: 32 * sum_i sc_i S_i, one madd of int16 pairs
    const __m128i sc16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m256i sc_words = _mm256_cvtepi8_epi16(sc16);
    // row's scaled products a (lanes in any order: only their sum is used) -> acc[r]
    const auto finish = [&](int r, __m256i a) {
      const int64_t row = r0 + r;
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ksum16.data() + (row * nbk + sb) * 16));
      const __m256i off = _mm256_madd_epi16(sc_words, s16);  // |.| <= 2 * 128 * 2032
      const __m128 A = _mm_cvtepi32_ps(hsum2_epi32(_mm256_sub_epi32(a, _mm256_slli_epi32(off, 5)), _mm256_setzero_si256()));
      acc[r] = _mm_fmadd_ps(A, _mm_mul_ps(d, _mm_set1_ps(x.kd[row * nbk + sb])), acc[r]);
    };
    __m256i q[8];  // block j's 6-bit codes
    kvserve::q6_k_codes(b, 0, q), kvserve::q6_k_codes(b, 1, q + 4);
    if (R == 1) {
      const int8_t* xk = x.k8.data() + r0 * x.K + 256 * sb;
      // the 32 weights of block j: first 16 scale sc[2j], last 16 sc[2j + 1] (int16 lanes, by one shuffle)
      const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
      __m256i a = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_broadcastsi128_si256(
            _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h))));
        for (int g = 0; g < 4; ++g) {
          const int j = 4 * h + g;
          const __m256i scj = _mm256_shuffle_epi8(w, _mm256_add_epi8(pick, _mm256_set1_epi8(static_cast<char>(4 * g))));
          const __m256i xj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk + 32 * k8_order(j)));
          a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], xj), scj));
        }
      }
      return finish(0, a);
    }
    // many rows: the codes transposed (transpose_k) and their scales in the same lanes: dword
    // lane m of tsc[g] is block 4g + m % 4's first-16 scale in the low half (t 0-3), second in the high
    __m256i t[8], tsc[2], tsc32[2];  // tsc32: the same scales, one int32 per lane
    const bool vnni = cpu_has_vnni();
    transpose_k(q, t);
    for (int g = 0; g < 2; ++g) {
      const char a = static_cast<char>(8 * g);
      tsc[g] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
          sc16, _mm_setr_epi8(a, a, a + 2, a + 2, a + 4, a + 4, a + 6, a + 6, a + 1, a + 1, a + 3, a + 3, a + 5, a + 5,
                              a + 7, a + 7)));
      tsc32[g] = _mm256_srai_epi32(_mm256_slli_epi32(tsc[g], 16), 16);
    }
    for (int r = 0; r < nr; ++r) {
      const __m256i* tx = reinterpret_cast<const __m256i*>(x.kq.data() + (r0 + r) * x.K + 256 * sb);
      __m256i a = _mm256_setzero_si256();
      for (int g = 0; g < 2; ++g) {
#ifdef KVSERVE_VNNI_BUILD
        if (vnni) {  // a lane's 4 quads share one scale: sum the products, then scale once (exact)
          __m256i u = _mm256_dpbusd_epi32(_mm256_setzero_si256(), t[4 * g], _mm256_loadu_si256(tx + 4 * g));
          for (int i = 1; i < 4; ++i) u = _mm256_dpbusd_epi32(u, t[4 * g + i], _mm256_loadu_si256(tx + 4 * g + i));
          a = _mm256_add_epi32(a, _mm256_mullo_epi32(u, tsc32[g]));
          continue;
        }
#endif
        for (int i = 0; i < 4; ++i)
          a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(t[4 * g + i], _mm256_loadu_si256(tx + 4 * g + i)), tsc[g]));
      }
      finish(r, a);
    }
  }
};

constexpr int kKRows = 16;  // rows per pass over the K-quant rows: the weights leave DRAM once per 16 rows

#ifdef KVSERVE_ZMM_ROWS
// ---- Many rows, two features per instruction (AVX512-VNNI builds): features n and n + 1's
// super-blocks sit in the low and the high 256 bits of each zmm, unpacked and transposed as the
// ymm many-row path does it (transpose_k's unpacks stay within 128-bit lanes), and each row's
// transposed activations are broadcast to both halves. Per row and super-block the two features'
// A (and B) are the same exact integers as in Q4_KRows / Q6_KRows, reduced together (hsum4_epi32),
// and [A_n, B_n, A_n+1, B_n+1] take one fmadd with [d_n dx, dmin_n dx, d_n+1 dx, dmin_n+1 dx]: lane
// for lane the one-row path's operations, so the floats are the same.

// [sum of a's low 8 lanes, of b's low 8, of a's high 8, of b's high 8] (exact).
inline __m128i hsum4_epi32(__m512i a, __m512i b) {
  a = _mm512_add_epi32(a, _mm512_shuffle_i64x2(a, a, _MM_SHUFFLE(2, 3, 0, 1)));  // 128-bit units u0+u1, u2+u3
  b = _mm512_add_epi32(b, _mm512_shuffle_i64x2(b, b, _MM_SHUFFLE(2, 3, 0, 1)));
  __m512i z = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));  // [a n, a n+1, b n, b n+1] (4 lanes each)
  z = _mm512_add_epi32(z, _mm512_shuffle_epi32(z, _MM_PERM_CDAB));
  z = _mm512_add_epi32(z, _mm512_shuffle_epi32(z, _MM_PERM_BADC));
  return _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 4, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), z));
}

inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
using kvserve::load_pair;  // block_codes.h
inline void transpose_k512(const __m512i* v, __m512i* out) {
  for (int g = 0; g < 2; ++g) {
    const __m512i* w = v + 4 * g;
    const __m512i a0 = _mm512_unpacklo_epi32(w[0], w[1]), a1 = _mm512_unpackhi_epi32(w[0], w[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(w[2], w[3]), a3 = _mm512_unpackhi_epi32(w[2], w[3]);
    out[4 * g] = _mm512_unpacklo_epi64(a0, a2), out[4 * g + 1] = _mm512_unpackhi_epi64(a0, a2);
    out[4 * g + 2] = _mm512_unpacklo_epi64(a1, a3), out[4 * g + 3] = _mm512_unpackhi_epi64(a1, a3);
  }
}

// Two features' super-block, ready for the rows: transposed codes t, per-lane int32 scales sc[g],
// `side` (Q4_K: the mins as int16, each twice; Q6_K: the 16 scales as int16) and dd.
struct PairBlock {
  __m512i t[8], sc[2], side;
  __m128 dd;  // Q4_K [d, dmin, d', dmin'], Q6_K [d, 0, d', 0]
};

template <bool kQ5>  // Q4_K or Q5_K (KRows)
inline void q4_k_pair(const uint8_t* b0, const uint8_t* b1, PairBlock& p) {
  constexpr int64_t kCodes = KRows<kQ5>::kCodes;
  const __m128i s0 = q4_k_scales(b0), s1 = q4_k_scales(b1);
  p.dd = _mm_cvtph_ps(_mm_setr_epi32(static_cast<int>(u32_at(b0)), static_cast<int>(u32_at(b1)), 0, 0));
  p.side = join(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s0, s0)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s1, s1)));
  const __m512i mask = _mm512_set1_epi8(15);
  __m512i q[8];
  for (int c = 0; c < 4; ++c) {
    const __m512i v = load_pair(b0 + kCodes + 32 * c, b1 + kCodes + 32 * c);
    q[2 * c] = _mm512_and_si512(v, mask);
    q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
  if (kQ5) {
    const __m512i qh = load_pair(b0 + 16, b1 + 16), one = _mm512_set1_epi8(1);
    for (int j = 0; j < 8; ++j)
      q[j] = _mm512_or_si512(q[j], _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4));
  }
  transpose_k512(q, p.t);
  __m256i w0[2], d0[2], w1[2], d1[2];
  per_transposed_lane(s0, w0, d0);
  per_transposed_lane(s1, w1, d1);
  p.sc[0] = join(d0[0], d1[0]), p.sc[1] = join(d0[1], d1[1]);
}

inline void q6_k_pair(const uint8_t* b0, const uint8_t* b1, PairBlock& p) {
  // fp16 lanes [d, 0, d', 0]
  p.dd = _mm_cvtph_ps(_mm_setr_epi32(u16_at(b0 + 208), u16_at(b1 + 208), 0, 0));
  const __m128i sc0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 192));
  const __m128i sc1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + 192));
  p.side = join(_mm256_cvtepi8_epi16(sc0), _mm256_cvtepi8_epi16(sc1));
  const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
  __m512i q[8];
  for (int h = 0; h < 2; ++h) {
    const __m512i l0 = load_pair(b0 + 64 * h, b1 + 64 * h), l1 = load_pair(b0 + 64 * h + 32, b1 + 64 * h + 32);
    const __m512i qh = load_pair(b0 + 128 + 32 * h, b1 + 128 + 32 * h);
    const auto high = [&](int shift) {
      return _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m2), 4);
    };
    q[4 * h] = _mm512_or_si512(_mm512_and_si512(l0, m4), high(0));
    q[4 * h + 1] = _mm512_or_si512(_mm512_and_si512(l1, m4), high(2));
    q[4 * h + 2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), high(4));
    q[4 * h + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), high(6));
  }
  transpose_k512(q, p.t);
  for (int g = 0; g < 2; ++g) {  // Q6_KRows' tsc32: block 4g + m % 4's first-16 scale (t 0-3), second (t 4-7)
    const char a = static_cast<char>(8 * g);
    const __m128i pick = _mm_setr_epi8(a, a + 2, a + 4, a + 6, a + 1, a + 3, a + 5, a + 7, -1, -1, -1, -1, -1, -1, -1, -1);
    p.sc[g] = join(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc0, pick)), _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc1, pick)));
  }
}

// Features n, n + 1 (their super-block rows at w0, w1) for rows [r0, r0 + nr): out[r * ldo + n], [.. + 1].
template <typename Format>  // KRows<.> or Q6_KRows
void pair_rows(const kvserve::Q8Act& x, int64_t r0, int nr, const uint8_t* w0, const uint8_t* w1, float* out,
               int64_t ldo) {
  constexpr int64_t kBytes = Format::kBytes;
  constexpr bool kQ4_K = Format::kCode != kQ6_K;  // Q4_K or Q5_K: the mins' B beside A
  const int64_t nb = x.K / 256;
  __m128 acc[kKRows];  // [acc, corr, acc', corr'] per row
  for (int r = 0; r < nr; ++r) acc[r] = _mm_setzero_ps();
  PairBlock p;
  for (int64_t sb = 0; sb < nb; ++sb) {
    const uint8_t *b0 = w0 + sb * kBytes, *b1 = w1 + sb * kBytes;
    prefetch_ahead(b0, kBytes), prefetch_ahead(b1, kBytes);
    if (Format::kCode == kQ6_K) q6_k_pair(b0, b1, p); else q4_k_pair<Format::kCode == kQ5_K>(b0, b1, p);
    for (int r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xq = x.kq.data() + row * x.K + 256 * sb;
      const auto xs = [&](int i) { return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i))); };
      __m512i a = _mm512_setzero_si512();
      for (int g = 0; g < 2; ++g) {
        const __m512i u = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), p.t[4 * g], xs(4 * g)), p.t[4 * g + 1], xs(4 * g + 1));
        const __m512i v = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), p.t[4 * g + 2], xs(4 * g + 2)), p.t[4 * g + 3], xs(4 * g + 3));
        a = _mm512_add_epi32(a, _mm512_mullo_epi32(_mm512_add_epi32(u, v), p.sc[g]));
      }
      const __m512i s16 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ksum16.data() + (row * nb + sb) * 16)));
      const __m512i side = _mm512_madd_epi16(p.side, s16);
      const __m128i ab = kQ4_K ? hsum4_epi32(a, side) : hsum4_epi32(_mm512_sub_epi32(a, _mm512_slli_epi32(side, 5)), _mm512_setzero_si512());
      acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(ab), _mm_mul_ps(p.dd, _mm_set1_ps(x.kd[row * nb + sb])), acc[r]);
    }
  }
  for (int r = 0; r < nr; ++r) {
    const __m128 v = _mm_sub_ps(acc[r], _mm_movehdup_ps(acc[r]));  // [n, *, n + 1, *]
    out[r * ldo] = _mm_cvtss_f32(v), out[r * ldo + 1] = _mm_cvtss_f32(_mm_movehl_ps(v, v));
  }
}

// ---- Many rows, 16 features per instruction (AVX512-VNNI builds; Q4_K and Q6_K, from
// kLaneMinRows rows): each zmm lane is one output feature, so a row's products need no horizontal
// sums. Per group of 16 features every super-block is unpacked once per call into a LaneBlock:
// code quad Q (k = 4Q .. 4Q + 3) of the 16 features as one zmm (dword f = feature f's 4 codes,
// transposed from the GGUF rows by 16 x 16 dword transposes), the sub-block scales as int32 lanes,
// and d (and dmin) as fp32 lanes. A row's 4 activation codes at quad Q are broadcast to every
// lane, so one vpdpbusd is 4 k of 16 features (pair_rows': of 2, then a 16-lane reduction per
// row and super-block, which bounded it at ~280 GOP/s on two Zen 4 cores). Per lane the integers
// are pair_rows' (A = sum_j sc_j I_j and B = sum_j m_j S_j, Q6_K's A = sum_i sc_i (I_i - 32 S_i)),
// exact in int32, and they reach fp32 by the same operations in the same order (acc = fma(A,
// d dx, acc), corr = fma(B, dmin dx, corr), result acc - corr), so every output equals the other
// kernels' bit for bit and a row's result does not depend on the rows beside it.

// a[f] (f < 16) -> a[i] whose dword f is the old a[f]'s dword i.
inline void transpose16(__m512i* a) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2)
    t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
  for (int i = 0; i < 16; i += 4) {  // a[4p + e]'s 128-bit lane l: rows 4p .. 4p + 3 at dword 4l + e
    a[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), a[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    a[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), a[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // lane l of a[e], a[4 + e], a[8 + e], a[12 + e] -> dword 4l + e
    const __m512i x0 = _mm512_shuffle_i32x4(a[e], a[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(a[e], a[4 + e], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(a[8 + e], a[12 + e], 0x44), x3 = _mm512_shuffle_i32x4(a[8 + e], a[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(x0, x2, 0x88), t[4 + e] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(x1, x3, 0x88), t[12 + e] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) a[i] = t[i];
}

// One super-block of 16 features, unpacked for the lanes kernel.
struct LaneBlock {
  __m512i q[64];    // code quad Q: dword f = feature f's codes at k = 4Q .. 4Q + 3 (unsigned)
  __m512i sc[16];   // Q4_K: sub-block j's scale (j < 8); Q6_K: sub-block i's (signed)
  __m512i side[8];  // int16 pairs against the activations' 16-code sums: Q4_K (m_j, m_j), Q6_K (sc_2p, sc_2p+1)
  __m512 d, dmin;   // Q6_K: dmin unused
};

// 16 fp16 values, one in the low (hi: the high) half of each dword of v, as fp32 lanes.
inline __m512 halves_ps(__m512i v, bool hi) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(v, 16) : v));
}

// The dwords at b + f * stride + offset (f < 16) as lanes.
inline __m512i dword_lanes(const uint8_t* b, int64_t stride, int64_t offset) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(static_cast<int>(stride)));
  return _mm512_i32gather_epi32(at, b + offset, 1);
}

// Q4_K / Q5_K's 6-bit scales and mins in lanes, as q4_k_scales takes them from the 12 bytes
// s0 s1 s2 (dwords, one lane per feature): j < 4 sc_j = s0.j & 63, m_j = s1.j & 63; j = 4 + i
// sc_j = (s2.i & 15) | (s0.i >> 6) << 4, m_j = (s2.i >> 4) | (s1.i >> 6) << 4 (s.i: byte i).
// Features b + f * stride (f < 16).
inline void lanes_q4_k(const uint8_t* b, int64_t stride, LaneBlock& L) {
  const __m512i s0 = dword_lanes(b, stride, 4), s1 = dword_lanes(b, stride, 8), s2 = dword_lanes(b, stride, 12);
  const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15), top = _mm512_set1_epi32(0x30);
  for (int i = 0; i < 4; ++i) {
    const unsigned sh = 8 * i;
    const __m512i m_lo = _mm512_and_si512(_mm512_srli_epi32(s1, sh), m6);
    const __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, sh + 4), m4),
                                         _mm512_and_si512(_mm512_srli_epi32(s1, sh + 2), top));
    L.sc[i] = _mm512_and_si512(_mm512_srli_epi32(s0, sh), m6);
    L.sc[4 + i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, sh), m4),
                                  _mm512_and_si512(_mm512_srli_epi32(s0, sh + 2), top));
    L.side[i] = _mm512_or_si512(m_lo, _mm512_slli_epi32(m_lo, 16));
    L.side[4 + i] = _mm512_or_si512(m_hi, _mm512_slli_epi32(m_hi, 16));
  }
  const __m512i dd = dword_lanes(b, stride, 0);  // [d, dmin] fp16
  L.d = halves_ps(dd, false), L.dmin = halves_ps(dd, true);
  const __m512i m15 = _mm512_set1_epi8(15);
  __m512i t[16];
  for (int c = 0; c < 2; ++c) {  // qs dwords 16c .. 16c + 15: dword D = 8 cc + q of 32-byte chunk cc
    for (int f = 0; f < 16; ++f) t[f] = _mm512_loadu_si512(b + f * stride + 16 + 64 * c);
    transpose16(t);
    for (int i = 0; i < 16; ++i) {  // low nibbles: sub-block 2 cc, quad q; high: 2 cc + 1
      const int cc = (16 * c + i) / 8, q = i % 8;
      L.q[16 * cc + q] = _mm512_and_si512(t[i], m15);
      L.q[16 * cc + 8 + q] = _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m15);
    }
  }
}

inline void lanes_q6_k(const uint8_t* b, int64_t stride, LaneBlock& L) {
  __m512i t[16], ql[32], qh[16];
  for (int f = 0; f < 16; ++f) t[f] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + f * stride + 192)));
  transpose16(t);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  for (int i = 0; i < 16; ++i) L.sc[i] = t[i];
  for (int p = 0; p < 8; ++p) L.side[p] = _mm512_or_si512(_mm512_and_si512(t[2 * p], low16), _mm512_slli_epi32(t[2 * p + 1], 16));
  L.d = halves_ps(dword_lanes(b, stride, 206), true), L.dmin = _mm512_setzero_ps();  // d: bytes 208-209 (the block's last)
  for (int c = 0; c < 2; ++c) {
    for (int f = 0; f < 16; ++f) ql[16 * c + f] = _mm512_loadu_si512(b + f * stride + 64 * c);
    transpose16(ql + 16 * c);
  }
  for (int f = 0; f < 16; ++f) qh[f] = _mm512_loadu_si512(b + f * stride + 128);
  transpose16(qh);
  // q6_k_codes' order: quad Q = 32h + 8c + q is ql dword 16h + 8(c & 1) + q's low (c < 2) or high
  // nibbles | qh dword 8h + q's bits 2c, 2c + 1 moved to bits 4, 5 (one shift by 4 - 2c, kept by
  // the 0x30 mask); the nibble and the two bits are merged by one bit select (vpternlogd 0xE4:
  // mask ? a : b)
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c)
      for (int q = 0; q < 8; ++q) {
        const __m512i l = ql[16 * h + 8 * (c & 1) + q], t = qh[8 * h + q];
        const __m512i lo4 = c < 2 ? l : _mm512_srli_epi16(l, 4);
        const __m512i high = c == 0 ? _mm512_slli_epi16(t, 4) : c == 1 ? _mm512_slli_epi16(t, 2)
                             : c == 2 ? t : _mm512_srli_epi16(t, 2);
        L.q[32 * h + 8 * c + q] = _mm512_ternarylogic_epi32(lo4, _mm512_and_si512(high, m30), m4, 0xE4);
      }
}

// Rows [r0, r0 + R) against a group's LaneBlocks: out[r * ldo + f] for f < 16.
template <bool kQ6, int R>
void lane_rows(const kvserve::Q8Act& x, int64_t r0, const LaneBlock* panel, float* out, int64_t ldo) {
  const int64_t nb = x.K / 256;
  __m512 acc[R], corr[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), corr[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const LaneBlock& L = panel[sb];
    const int8_t* xs[R];
    const int16_t* s16[R];
    for (int r = 0; r < R; ++r)
      xs[r] = x.k8.data() + (r0 + r) * x.K + 256 * sb, s16[r] = x.ksum16.data() + ((r0 + r) * nb + sb) * 16;
    __m512i A[R];
    for (int r = 0; r < R; ++r) A[r] = _mm512_setzero_si512();
    constexpr int kSub = kQ6 ? 2 : 1, kQuads = 8 / kSub;  // sub-blocks per 32-block (Q6_K: of 16 weights)
    for (int blk = 0; blk < 8; ++blk) {
      const int64_t at = 32 * k8_order(blk);  // Q8Act::k8's 32-blocks are in k8_order
#pragma GCC unroll 2
      for (int h = 0; h < kSub; ++h) {
        __m512i I[R];
        for (int r = 0; r < R; ++r) I[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = kQuads * h; q < kQuads * (h + 1); ++q) {
          const __m512i w = L.q[8 * blk + q];
          for (int r = 0; r < R; ++r) I[r] = _mm512_dpbusd_epi32(I[r], w, quad_at16(xs[r] + at, q));
        }
        for (int r = 0; r < R; ++r) A[r] = _mm512_add_epi32(A[r], _mm512_mullo_epi32(I[r], L.sc[kSub * blk + h]));
      }
    }
    __m512i side[R];  // rows side by side: each is a chain of 8 dependent vpdpwssd
    for (int r = 0; r < R; ++r) side[r] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p)
      for (int r = 0; r < R; ++r)  // the pair (s16[2p], s16[2p + 1]) is dword p
        side[r] = _mm512_dpwssd_epi32(side[r], L.side[p], quad_at16(reinterpret_cast<const int8_t*>(s16[r]), p));
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.kd[(r0 + r) * nb + sb]);
      if (kQ6) {
        A[r] = _mm512_sub_epi32(A[r], _mm512_slli_epi32(side[r], 5));
      } else {
        corr[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(side[r]), _mm512_mul_ps(L.dmin, dx), corr[r]);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A[r]), _mm512_mul_ps(L.d, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_sub_ps(acc[r], corr[r]));
}

// The zmm lanes for lanes_q8 (below): 16 features a group.
struct ZmmLanes {
  static constexpr int64_t kWidth = 16;
  template <bool kQ6>
  static constexpr int kGroups = 1;  // vpdpbusd takes the broadcast as a memory operand
  using Block = LaneBlock;
  template <bool kQ6>
  static void unpack(const uint8_t* b, int64_t stride, Block& L) {
    if (kQ6) lanes_q6_k(b, stride, L); else lanes_q4_k(b, stride, L);
  }
  static constexpr bool kPrefetchInRows = false;  // the next pass is prefetched as it is unpacked (lanes_q8)
  template <bool kQ6, int R, int G>
  static void rows(const kvserve::Q8Act& x, int64_t r0, const Block* panel, float* out, int64_t ldo, LineSpan) {
    static_assert(G == 1);
    lane_rows<kQ6, R>(x, r0, panel, out, ldo);
  }
};
#endif

// ---- Many rows, 8 features per instruction (AVX2; Q4_K and Q6_K, from kLaneMinRows rows, where
// the 16-feature zmm lanes above do not run): lane_rows' scheme in ymm registers. Each dword lane
// is one output feature; code quad Q of 8 features is one ymm (transposed from the GGUF rows by
// 8 x 8 dword transposes) and a row's 4 activation codes at quad Q are broadcast to every lane.
// Without vpdpbusd a quad's products take maddubs (two int16 sums of two products per lane) and
// are summed in int16 before one madd by the sub-block's scale, duplicated in both int16 halves
// of the lane, reaches int32: Q4_K 8 quads (<= 8 * 2 * 15 * 127 = 30480), Q6_K's 6-bit codes 2
// (<= 2 * 2 * 63 * 127 = 32004), so no sum saturates. Per lane the integers A and B are those of
// the other K-quant kernels, exact in int32, and they reach fp32 by the same operations in the
// same order, so every output equals theirs bit for bit. The transposed many-row path it replaces
// (KRows' `t`) spent ~40 instructions per row, feature and super-block, a third of them on the
// horizontal sums; here ~19. On a Zen 3, 2 threads, the 1B Q4_K_M's matrices from DRAM
// (bench.probes.quant_linear --int8): 16 rows 146-160 -> 169-180 GFLOP/s (Q4_K), 124-127 ->
// 171-179 (Q6_K); 64 rows 139-143 -> 184-264 (Q4_K), 121-128 -> 161-234 (Q6_K); the Q4_K from 4
// rows, Q6_K (whose unpack costs ~2.5 rows' products) from 8, as for the zmm lanes.

// a[f] (f < 8) -> a[i] whose dword f is the old a[f]'s dword i.
inline void transpose8(__m256i* a) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2)
    t[i] = _mm256_unpacklo_epi32(a[i], a[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(a[i], a[i + 1]);
  for (int i = 0; i < 8; i += 4) {  // u[i + e]: rows i .. i + 3 at dwords e (low 128 bits) and 4 + e (high)
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e)
    a[e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x20), a[4 + e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x31);
}

// a[i] (i < 4): dword f = dword i of the 16 bytes at b + f * stride (f < 8). Features f and f + 4
// share a register (a 128-bit load and an insert), so this is a 4 x 4 transpose inside the 128-bit
// lanes: 8 in-lane shuffles.
inline void load_transposed4(const uint8_t* b, int64_t stride, __m256i* a) {
  __m256i r[4];
  for (int f = 0; f < 4; ++f)
    r[f] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + f * stride))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (f + 4) * stride)), 1);
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  a[0] = _mm256_unpacklo_epi64(t0, t2), a[1] = _mm256_unpackhi_epi64(t0, t2);
  a[2] = _mm256_unpacklo_epi64(t1, t3), a[3] = _mm256_unpackhi_epi64(t1, t3);
}
// a[i] (i < 8): dword f = dword i of the 32 bytes at b + f * stride (f < 8): two halves, 16 in-lane
// shuffles, where transpose8 of whole rows takes 24, 8 of them lane-crossing.
inline void load_transposed8(const uint8_t* b, int64_t stride, __m256i* a) {
  for (int h = 0; h < 2; ++h) load_transposed4(b + 16 * h, stride, a + 4 * h);  // dwords 4h .. 4h + 3
}

// One super-block of 8 features, unpacked for lane8_rows.
struct LaneBlock8 {
  __m256i q[64];    // code quad Q: dword f = feature f's codes at k = 4Q .. 4Q + 3 (unsigned)
  __m256i sc[16];   // the scale (s, s) as int16 pairs: Q4_K sub-block j's (j < 8), Q6_K sub-block i's (signed)
  __m256i side[8];  // int16 pairs: Q4_K side[p < 4] = (m_2p, m_2p+1) against the 32-code sums, Q6_K (sc_2p, sc_2p+1) against the 16-code sums
  __m256 d, dmin;   // Q6_K: dmin unused
};

// The dwords at b + f * stride + offset (f < 8) as lanes.
inline __m256i dword_lanes8(const uint8_t* b, int64_t stride, int64_t offset) {
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(stride)));
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(b + offset), at, 1);
}

// 8 fp16 values, one in the low (hi: the high) half of each dword of v, as fp32 lanes.
inline __m256 halves8_ps(__m256i v, bool hi) {
  const __m256i pick = hi ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                             2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                          : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);  // qwords 0, 2 -> low 128 bits
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

// Both int16 halves of each dword = its low half (hi: its high half).
inline __m256i twice16(__m256i v, bool hi) {
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  return hi ? _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_andnot_si256(low, v))
            : _mm256_or_si256(_mm256_and_si256(v, low), _mm256_slli_epi32(v, 16));
}

// Q4_K: lanes_q4_k's scales and mins (s0 s1 s2, byte i of each) for features b + f * stride (f < 8).
inline void lanes8_q4_k(const uint8_t* b, int64_t stride, LaneBlock8& L) {
  // the 16-byte heads [d dmin, s0, s1, s2] by 8 loads and an in-lane transpose: four gathers
  // (dword_lanes8) cost 1.03-1.07x at 4 rows, where the unpack is ~45% of a pass
  __m256i head[4];
  load_transposed4(b, stride, head);
  const __m256i s0 = head[1], s1 = head[2], s2 = head[3];
  const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15), top = _mm256_set1_epi32(0x30);
  __m256i mins[8];  // sub-block j's min in the low int16 of each dword
  for (int i = 0; i < 4; ++i) {
    const int sh = 8 * i;
    mins[i] = _mm256_and_si256(_mm256_srli_epi32(s1, sh), m6);
    mins[4 + i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, sh + 4), m4),
                                  _mm256_and_si256(_mm256_srli_epi32(s1, sh + 2), top));
    L.sc[i] = twice16(_mm256_and_si256(_mm256_srli_epi32(s0, sh), m6), false);
    L.sc[4 + i] = twice16(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, sh), m4),
                                          _mm256_and_si256(_mm256_srli_epi32(s0, sh + 2), top)), false);
  }
  for (int p = 0; p < 4; ++p) L.side[p] = _mm256_or_si256(mins[2 * p], _mm256_slli_epi32(mins[2 * p + 1], 16));
  const __m256i dd = head[0];  // [d, dmin] fp16
  L.d = halves8_ps(dd, false), L.dmin = halves8_ps(dd, true);
  const __m256i m15 = _mm256_set1_epi8(15);
  __m256i t[8];
  for (int cc = 0; cc < 4; ++cc) {  // 32-byte chunk cc: low nibbles sub-block 2 cc, high 2 cc + 1, quad q = dword q
    load_transposed8(b + 16 + 32 * cc, stride, t);
    for (int q = 0; q < 8; ++q) {
      L.q[16 * cc + q] = _mm256_and_si256(t[q], m15);
      L.q[16 * cc + 8 + q] = _mm256_and_si256(_mm256_srli_epi16(t[q], 4), m15);
    }
  }
}

inline void lanes8_q6_k(const uint8_t* b, int64_t stride, LaneBlock8& L) {
  __m256i t[8], ql[32], qh[16];
  // feature f's 16 scales as int16: dword p = (sc_2p, sc_2p+1), transposed to lanes: side[p]
  for (int f = 0; f < 8; ++f) t[f] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + f * stride + 192)));
  transpose8(t);
  for (int p = 0; p < 8; ++p) L.side[p] = t[p], L.sc[2 * p] = twice16(t[p], false), L.sc[2 * p + 1] = twice16(t[p], true);
  L.d = halves8_ps(dword_lanes8(b, stride, 206), true), L.dmin = _mm256_setzero_ps();  // d: bytes 208-209 (the block's last)
  for (int c = 0; c < 4; ++c) load_transposed8(b + 32 * c, stride, ql + 8 * c);  // ql dword 8c + q -> ql[8c + q]
  for (int c = 0; c < 2; ++c) load_transposed8(b + 128 + 32 * c, stride, qh + 8 * c);
  // lanes_q6_k's order: quad 32h + 8c + q is ql dword 16h + 8(c & 1) + q's low (c < 2) or high
  // nibbles | qh dword 8h + q's bits 2c, 2c + 1 at bits 4, 5
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c)
      for (int q = 0; q < 8; ++q) {
        const __m256i l = ql[16 * h + 8 * (c & 1) + q], t2 = qh[8 * h + q];
        const __m256i lo4 = _mm256_and_si256(c < 2 ? l : _mm256_srli_epi16(l, 4), m4);
        const __m256i high = c == 0 ? _mm256_slli_epi16(t2, 4) : c == 1 ? _mm256_slli_epi16(t2, 2)
                             : c == 2 ? t2 : _mm256_srli_epi16(t2, 2);
        L.q[32 * h + 8 * c + q] = _mm256_or_si256(lo4, _mm256_and_si256(high, m30));
      }
}

// Row code quad q of the 32 codes at xq, broadcast to every lane.
inline __m256i quad8(const int8_t* xq, int q) {
  int32_t v;
  std::memcpy(&v, xq + 4 * q, 4);
  return _mm256_set1_epi32(v);
}

// Rows [r0, r0 + R) against G groups' LaneBlock8s (super-block sb of group g at panel[sb * G + g]):
// out[r * ldo + 8 g + f] for f < 8. Each broadcast row quad serves the G groups' maddubs: on a
// Zen 3 the broadcasts, not the products, bound one group (a register loop of Q4_K's runs: one
// group of 4 rows 105 G multiply-adds a second a core, two groups 141). In the kernel, with the
// unpack and the per-super-block sums, two groups of Q4_K ran 1.06-1.11x at 16-64 rows (one
// thread, cache-resident matrices); Q6_K, whose sums A take a madd every 2 quads, ran no faster
// (YmmLanes::kGroups).
template <bool kQ6, int R, int G>
void lane8_rows(const kvserve::Q8Act& x, int64_t r0, const LaneBlock8* panel, float* out, int64_t ldo, LineSpan next) {
  const int64_t nb = x.K / 256;
  // With two groups the sums kept across runs and super-blocks stay in memory (a laundered
  // pointer, so GCC does not keep them in registers): the run's sums, the weights and the
  // broadcast fill the 16 ymm registers, and GCC otherwise reloaded the weights for every row.
  alignas(32) __m256 acc_at[G][R], corr_at[G][R];
  alignas(32) __m256i A_at[G][R];
  __m256 (*acc)[R] = acc_at, (*corr)[R] = corr_at;
  __m256i (*A)[R] = A_at;
  if constexpr (G > 1) asm("" : "+r"(acc), "+r"(corr), "+r"(A));
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_ps(), corr[g][r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const LaneBlock8* L = panel + sb * G;
    const int8_t* xs[R];
    for (int r = 0; r < R; ++r) xs[r] = x.k8.data() + (r0 + r) * x.K + 256 * sb;
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) A[g][r] = _mm256_setzero_si256();
    // int16 sums of kRun quads, each then scaled by its sub-block's scale (Q6_K: two runs a sub-block of 16)
    constexpr int kRun = kQ6 ? 2 : 8;
    for (int blk = 0; blk < 8; ++blk) {
      next.step(8 * sb + blk);  // the next pass's lines, a few each 32-block (lanes_q8)
      const int64_t at = 32 * k8_order(blk);  // Q8Act::k8's 32-blocks are in k8_order
#pragma GCC unroll 4
      for (int q0 = 0; q0 < 8; q0 += kRun) {
        __m256i I[G][R];
        for (int r = 0; r < R; ++r) {
          const __m256i b = quad8(xs[r] + at, q0);
          for (int g = 0; g < G; ++g) I[g][r] = _mm256_maddubs_epi16(L[g].q[8 * blk + q0], b);
        }
#pragma GCC unroll 8
        for (int q = q0 + 1; q < q0 + kRun; ++q) {
          __m256i w[G];
          for (int g = 0; g < G; ++g) w[g] = L[g].q[8 * blk + q];
          for (int r = 0; r < R; ++r) {
            const __m256i b = quad8(xs[r] + at, q);
            for (int g = 0; g < G; ++g) {
              I[g][r] = _mm256_add_epi16(I[g][r], _mm256_maddubs_epi16(w[g], b));
              asm("" : "+x"(I[g][r]));  // keeps the sums a chain: GCC's reassociation computed every product first and spilled them
            }
          }
        }
        for (int g = 0; g < G; ++g) {
          const __m256i scale = L[g].sc[kQ6 ? 2 * blk + q0 / 4 : blk];
          for (int r = 0; r < R; ++r) A[g][r] = _mm256_add_epi32(A[g][r], _mm256_madd_epi16(I[g][r], scale));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int16_t* s16 = x.ksum16.data() + ((r0 + r) * nb + sb) * 16;
      const __m256 dx = _mm256_set1_ps(x.kd[(r0 + r) * nb + sb]);
      // Q4_K: the row's 8 sums of 32 codes (hadd of the 16-code sums, <= 4064), pair p (dword p) in
      // every dword of S[p], once for the G groups: 4 madds a group where the 16-code sums took 8
      // (1.01-1.07x at 4-512 rows); the same integers, so the same floats
      __m256i S[4];
      if constexpr (!kQ6) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16));
        const __m256i P = _mm256_broadcastsi128_si256(_mm_hadd_epi16(lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + 8))));
        S[0] = _mm256_shuffle_epi32(P, 0x00), S[1] = _mm256_shuffle_epi32(P, 0x55);
        S[2] = _mm256_shuffle_epi32(P, 0xAA), S[3] = _mm256_shuffle_epi32(P, 0xFF);
      }
      for (int g = 0; g < G; ++g) {
        __m256i side;
        if constexpr (kQ6) {  // the pair (s16[2p], s16[2p + 1]) is dword p
          const int8_t* s8 = reinterpret_cast<const int8_t*>(s16);
          side = _mm256_madd_epi16(L[g].side[0], quad8(s8, 0));
          for (int p = 1; p < 8; ++p) side = _mm256_add_epi32(side, _mm256_madd_epi16(L[g].side[p], quad8(s8, p)));
        } else {
          side = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(L[g].side[0], S[0]), _mm256_madd_epi16(L[g].side[1], S[1])),
                                  _mm256_add_epi32(_mm256_madd_epi16(L[g].side[2], S[2]), _mm256_madd_epi16(L[g].side[3], S[3])));
        }
        if (kQ6) {
          A[g][r] = _mm256_sub_epi32(A[g][r], _mm256_slli_epi32(side, 5));
        } else {
          corr[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(side), _mm256_mul_ps(L[g].dmin, dx), corr[g][r]);
        }
        acc[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A[g][r]), _mm256_mul_ps(L[g].d, dx), acc[g][r]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + 8 * g, _mm256_sub_ps(acc[g][r], corr[g][r]));
}

// The ymm lanes for lanes_q8: 8 features a group.
struct YmmLanes {
  static constexpr int64_t kWidth = 8;
  template <bool kQ6>
  static constexpr int kGroups = kQ6 ? 1 : 2;  // groups a pass shares its broadcasts among (lane8_rows)
  using Block = LaneBlock8;
  template <bool kQ6>
  static void unpack(const uint8_t* b, int64_t stride, Block& L) {
    if (kQ6) lanes8_q6_k(b, stride, L); else lanes8_q4_k(b, stride, L);
  }
  static constexpr bool kPrefetchInRows = true;  // lane8_rows prefetches the next pass as it computes
  template <bool kQ6, int R, int G>
  static void rows(const kvserve::Q8Act& x, int64_t r0, const Block* panel, float* out, int64_t ldo, LineSpan next) {
    lane8_rows<kQ6, R, G>(x, r0, panel, out, ldo, next);
  }
};

// Where the zmm lanes beat pair_rows (python -m bench.probes.quant_linear --gguf <the 1B Q4_K_M> --int8,
// 2 threads, each matrix from DRAM): Q4_K from 4 rows (4 rows 1.2-1.3x, 16 rows 1.6-1.8x), Q6_K
// from 8 (its unpack costs more: at 4 rows the 49152 x 2048 LM head ran 1.25x slower, at 8 rows
// 2048 x 8192 1.25x faster; 16 rows 1.2-1.5x). Fewer rows: unpacking a group costs more than
// pair_rows' reductions.
// The ymm lanes start at the same row counts (the Q6_K unpack costs ~2.5 rows' products there).
// Measured again with the in-lane transposes (one thread, cache-resident): Q4_K lanes at 1 row
// ran 0.75x the row kernel, at 2-3 rows even; Q6_K lanes at 4-7 rows 1.05-1.2x, but the LM head
// from DRAM at 4 and 6 rows 1.2x slower, so the thresholds stay.
template <bool kQ6>
constexpr int kLaneMinRows = kQ6 ? 8 : 4;
// Rows a pass, both widths: zmm, 6 spilled registers and ran slower; ymm, one group 6 no faster,
// two groups 5 or 6 no faster in the register loop.
constexpr int kLaneRows = 4;

// Every row against G groups unpacked in panel (panel[sb * G + g]), kLaneRows a pass.
// The first pass of rows prefetches `next`.
template <typename Lanes, bool kQ6, int G>
void lanes_rows(const kvserve::Q8Act& x, const typename Lanes::Block* panel, float* out, int64_t ldo, LineSpan next) {
  row_passes<kLaneRows, 2, 1>(0, x.M, [&](auto rows, int64_t r) {
    Lanes::template rows<kQ6, decltype(rows)::value, G>(x, r, panel, out + r * ldo, ldo, r == 0 ? next : LineSpan{});
  });
}

// Whole groups of Lanes::kWidth features from n0 for every row, on the lanes kernel of that
// width (ZmmLanes, YmmLanes), Lanes::kGroups groups a pass where as many are left: returns where
// they end.
template <typename Lanes, bool kQ6>
int64_t lanes_q8(const kvserve::Q8Act& x, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int64_t kBytes = kQ6 ? kQ6_KBytes : kQ4_KBytes, kWidth = Lanes::kWidth;
  constexpr int kG = Lanes::template kGroups<kQ6>;
  const int64_t nb = x.K / 256;
  thread_local std::vector<typename Lanes::Block> panel;
  panel.resize(nb * kG);
  int64_t n = n0;
  while (n + kWidth <= n1) {
    const int g = n + kG * kWidth <= n1 ? kG : 1;
    const int64_t next = n + g * kWidth, ahead = std::min(n1, next + g * kWidth);
    // The next pass's features into L2: below ~16 rows a call waits on DRAM, and the hardware
    // prefetcher does not follow 16 interleaved streams (prefetch_ahead's 8 KB lands inside this
    // group, ~20% slower at 16 rows of the 1B's LM head in zmm lanes). Their rows are contiguous.
    // The ymm lanes spread the prefetches over the first pass of rows (LineSpan): issued all
    // during the unpack they wait for miss buffers there and the memory idles during the
    // products (Zen 3, 2 threads, Q4_K 8192 x 2048 from DRAM: 4 rows 1.26x, 8 rows 1.19x, 16-32
    // rows 1.06-1.07x); the zmm lanes keep the per-super-block prefetches they were measured with.
    const LineSpan next_pass(w + next * nb * kBytes, (ahead - next) * nb * kBytes, 8 * nb);
    for (int64_t sb = 0; sb < nb; ++sb) {
      if constexpr (!Lanes::kPrefetchInRows)
        for (int64_t f = next; f < ahead; ++f) prefetch_range(w + (f * nb + sb) * kBytes, kBytes);
      for (int gi = 0; gi < g; ++gi)  // group gi's feature f: super-block sb at w + ((n + gi kWidth + f) nb + sb) kBytes
        Lanes::template unpack<kQ6>(w + ((n + gi * kWidth) * nb + sb) * kBytes, nb * kBytes, panel[sb * g + gi]);
    }
    if (g == kG) lanes_rows<Lanes, kQ6, kG>(x, panel.data(), out + n, ldo, next_pass);
    else lanes_rows<Lanes, kQ6, 1>(x, panel.data(), out + n, ldo, next_pass);
    n = next;
  }
  return n;
}

#ifdef KVSERVE_ZMM_ROWS
// One row against features n .. n + 3 (their super-block rows from w; VNNI CPUs): out[0 .. 3]. The
// integers of each are the one-feature pass's (Format::one_row), their 8 sums reduced in one tree
// rather than four, and the four features' floats are one 8-lane vector, lane 2i feature i's acc
// and lane 2i + 1 its corr, each taking exactly the one-feature pass's operations (acc = fma(A,
// d dx, acc), corr = fma(B, dmin dx, corr), then acc - corr): the same outputs, bit for bit. The
// reductions and floats were ~14% of a one-row Q4_K pass (one thread, in L2).
template <typename Format>
void quad_row(const kvserve::Q8Act& x, int64_t r0, const uint8_t* w, float* out) {
  constexpr int64_t kBytes = Format::kBytes;
  const int64_t nb = x.K / 256;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ksum16.data() + (r0 * nb + sb) * 16));
    const int8_t* xk = x.k8.data() + r0 * x.K + 256 * sb;
    __m256i a[4], side[4];
    int dd[4];
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = w + (i * nb + sb) * kBytes;
      prefetch_ahead(b, kBytes);
      Format::one_row(b, xk, s16, a[i], side[i]);
      dd[i] = static_cast<int>(Format::scales(b));
    }
    // [A0, B0, A1, B1 | A2, B2, A3, B3]
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], side[0]), _mm256_hadd_epi32(a[1], side[1]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[2], side[2]), _mm256_hadd_epi32(a[3], side[3]));
    const __m256i v = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
    const __m256 scale = _mm256_cvtph_ps(_mm_setr_epi32(dd[0], dd[1], dd[2], dd[3]));  // [d0, dmin0, d1, ...]
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(scale, _mm256_set1_ps(x.kd[r0 * nb + sb])), acc);
  }
  alignas(32) float diff[8];
  _mm256_store_ps(diff, _mm256_sub_ps(acc, _mm256_movehdup_ps(acc)));
  for (int i = 0; i < 4; ++i) out[i] = diff[2 * i];
}
#endif

// Output features [n0, n1) for rows [r0, r0 + rn), rn <= kKRows (R: the count at compile time,
// or 0): out[r * ldo + n]. Feature n's row of super-blocks (<= a few KB) is read once from
// memory and each super-block serves every row.
template <typename Format, int R>
void rows_q8(const kvserve::Q8Act& x, int64_t r0, int rn, const uint8_t* w, int64_t n0, int64_t n1, float* out,
             int64_t ldo) {
  const int nr = R ? R : rn;
  const int64_t nb = x.K / 256;
  int64_t n = n0;
#ifdef KVSERVE_ZMM_ROWS
  if (R != 1 && cpu_has_vnni())
    for (; n + 2 <= n1; n += 2)
      pair_rows<Format>(x, r0, nr, w + n * nb * Format::kBytes,
                                                       w + (n + 1) * nb * Format::kBytes, out + n, ldo);
  if (R == 1 && cpu_has_vnni())
    for (; n + 4 <= n1; n += 4) quad_row<Format>(x, r0, w + n * nb * Format::kBytes, out + n);
#endif
  for (; n < n1; ++n) {
    __m128 acc[R ? R : kKRows];  // [acc, corr, 0, 0] per row
    for (int r = 0; r < nr; ++r) acc[r] = _mm_setzero_ps();
    const uint8_t* row = w + n * nb * Format::kBytes;
    for (int64_t sb = 0; sb < nb; ++sb) {
      prefetch_ahead(row + sb * Format::kBytes, Format::kBytes);
      Format::template block<R>(row + sb * Format::kBytes, x, r0, nr, sb, acc);
    }
    for (int r = 0; r < nr; ++r) out[r * ldo + n] = _mm_cvtss_f32(_mm_sub_ss(acc[r], _mm_movehdup_ps(acc[r])));
  }
}

template <typename Format>
void rows_q8_all(const kvserve::Q8Act& x, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  n0 = kvserve::kquant_rows_amx(x, w, Format::kCode, n0, n1, out, ldo);  // whole groups of 16 on AMX tiles, where it runs
  constexpr bool kQ6 = Format::kCode == kQ6_K;
#ifdef KVSERVE_ZMM_ROWS
  if (Format::kCode != kQ5_K && x.M >= kLaneMinRows<kQ6> && cpu_has_vnni())  // whole groups of 16 in zmm lanes
    n0 = lanes_q8<ZmmLanes, kQ6>(x, w, n0, n1, out, ldo);
#endif
  if (Format::kCode != kQ5_K && x.M >= kLaneMinRows<kQ6>)  // whole groups of 8 in ymm lanes (all of them on AVX2 CPUs)
    n0 = lanes_q8<YmmLanes, kQ6>(x, w, n0, n1, out, ldo);
  if (n0 >= n1) return;
  for (int64_t r = 0; r < x.M; r += kKRows) {
    float* o = out + r * ldo;
    const int rn = static_cast<int>(std::min<int64_t>(kKRows, x.M - r));
    if (rn == 1)
      rows_q8<Format, 1>(x, r, 1, w, n0, n1, o, ldo);
    else
      rows_q8<Format, 0>(x, r, rn, w, n0, n1, o, ldo);
  }
}

// ---- Legacy row formats (Q4_0, Q5_1: GGUF rows of 32-weight blocks) against the per-32
// activations (Q8Act kBlocks). The codes of 4 blocks are unpacked once for all rows of the pass;
// per row and block an exact integer dot product in int32 lanes (maddubs, madd by 1; |pair| <=
// 2 * 31 * 127) is scaled lane-wise by d dx, the 4 blocks' products summed in a fixed tree and
// added to the row's accumulator (one dependent add per 4 blocks, not one fmadd per block, which
// bound one row at ~5 GB/s), one horizontal sum per output. Q4_0 stores q with w = d (q - 8):
// the signed codes multiply by llama.cpp's sign trick, |w| times x with w's sign
// (maddubs needs one unsigned operand). Q5_1's w = d q + m adds m s_x per block (s_x = dx * the
// activation codes' sum, Q8Act::s), summed per group the same way into a scalar. A row's
// operations do not depend on the other rows of the pass, so its result does not either.
template <int64_t kFmt, int R>  // R: the row count at compile time (1: registers), or 0: rn
void legacy_rows(const kvserve::Q8Act& x, int64_t r0, int rn, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                 int64_t ldo) {
  const int nr = R ? R : rn;
  constexpr int64_t kBytes = block_bytes(kFmt);
  constexpr bool kSigned = kFmt != kQ5_1;
  constexpr int kGroup = 4;
  const int64_t nb = x.K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R ? R : kKRows];
    float corr[R ? R : kKRows];
    for (int r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps(), corr[r] = 0.f;
    const uint8_t* row = w + n * nb * kBytes;
    for (int64_t b0 = 0; b0 < nb; b0 += kGroup) {
      const int g = static_cast<int>(std::min<int64_t>(kGroup, nb - b0));
      __m256i q[kGroup], uq[kGroup];  // Q4_0: the signed codes q - 8, and |.|; Q5_1: q
      float d[kGroup], m[kGroup];
      for (int i = 0; i < g; ++i) {
        const uint8_t* blk = row + (b0 + i) * kBytes;
        prefetch_ahead(blk, kBytes);
        d[i] = _cvtsh_ss(u16_at(blk));
        if (kFmt == kQ4_0) q[i] = _mm256_sub_epi8(kvserve::q4_codes(blk + 2), _mm256_set1_epi8(8));
        else q[i] = kvserve::q5_codes(blk + 4, blk + 8), m[i] = _cvtsh_ss(u16_at(blk + 2));
        uq[i] = kSigned ? _mm256_sign_epi8(q[i], q[i]) : q[i];
      }
      for (int r = 0; r < nr; ++r) {
        const int64_t xb = (r0 + r) * nb + b0;
        __m256 p[kGroup];
        for (int i = 0; i < g; ++i) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q8.data() + (xb + i) * kBlock));
          if (kSigned) xv = _mm256_sign_epi8(xv, q[i]);
          p[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(uq[i], xv), ones)),
                               _mm256_set1_ps(d[i] * x.d[xb + i]));
        }
        if (kFmt == kQ5_1) {  // the group's m s_x, summed as the products are (one dependent add per group)
          float c[kGroup];
          for (int i = 0; i < g; ++i) c[i] = m[i] * x.s[xb + i];
          corr[r] += g == kGroup ? (c[0] + c[1]) + (c[2] + c[3]) : g == 3 ? (c[0] + c[1]) + c[2] : g == 2 ? c[0] + c[1] : c[0];
        }
        // the group's sum: ((p0 + p1) + (p2 + p3)) for a whole group; the tail group left to right
        const __m256 sum = g == kGroup ? _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]))
                           : g == 3    ? _mm256_add_ps(_mm256_add_ps(p[0], p[1]), p[2])
                           : g == 2    ? _mm256_add_ps(p[0], p[1])
                                       : p[0];
        acc[r] = _mm256_add_ps(acc[r], sum);
      }
    }
    for (int r = 0; r < nr; ++r) out[r * ldo + n] = hsum8(acc[r]) + corr[r];
  }
}

template <int64_t kFmt>
void legacy_rows_all(const kvserve::Q8Act& x, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  for (int64_t r = 0; r < x.M; r += kKRows) {
    const int rn = static_cast<int>(std::min<int64_t>(kKRows, x.M - r));
    if (rn == 1)
      legacy_rows<kFmt, 1>(x, r, 1, w, n0, n1, out + r * ldo, ldo);
    else
      legacy_rows<kFmt, 0>(x, r, rn, w, n0, n1, out + r * ldo, ldo);
  }
}

template <bool kQ5, int R>
struct NibbleKernel {
  static constexpr int64_t kFormat = kQ5 ? kQ5_0 : kQ4_1;
  static constexpr int kMaxRows = 16;  // 16 accumulators spill, but the strip-block re-lay is shared by more rows
  static constexpr bool kRelays = true;  // passes over more than 16 rows share one re-lay (relay_all)
  static void run(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, float* o, int64_t ldo, int64_t cols) {
    strip_nibbles<kQ5, R>(x, r0, s, o, ldo, cols);  // ymm vpdpbusd measured slower here (see cpu_has_vnni)
  }
  static void run_pair(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, int64_t bytes, float* o, int64_t ldo,
                       const uint8_t* relaid) {
    if (relaid) pair_nibbles<kQ5, true, R>(x, r0, s, bytes, o, ldo, relaid);
    else pair_nibbles<kQ5, false, R>(x, r0, s, bytes, o, ldo, nullptr);
  }
  static void relay_pair(const uint8_t* a, int64_t bytes, int64_t nb, std::vector<uint8_t>& out) {
    relay_all(a, bytes, strip_block_bytes(kFormat), nb, kQ5 ? relay_q5_0_pair : relay_q4_1_pair, out);
  }
  static constexpr bool kPairs8 = true;  // AVX2 alone: full strip pairs in ymm from kPair8MinRows rows
  static void relay_pair8(const uint8_t* a, int64_t bytes, int64_t nb, std::vector<StripPair8>& out) {
    relay_strip_pair8<kQ5>(a, bytes, nb, out);
  }
  static void run_pair8(const kvserve::Q8Act& x, int64_t r0, const StripPair8* relaid, float* o, int64_t ldo) {
    pair8_nibbles<kQ5, R>(x, r0, relaid, o, ldo);
  }
};
template <int R>
using Q4_1Kernel = NibbleKernel<false, R>;
template <int R>
using Q5_0Kernel = NibbleKernel<true, R>;
template <int R>
struct Q8_0Kernel {
  static constexpr int64_t kFormat = kQ8_0;
  static constexpr int kMaxRows = 8;
  static constexpr bool kRelays = false;  // its k-quads are loaded as they are: a copy would only add stores
  static constexpr bool kPairs8 = false;  // AVX2 alone: one strip a pass (no run_pair8)
  static void run(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, float* o, int64_t ldo, int64_t cols) {
    strip_q8_0<R>(x, r0, s, o, ldo, cols);
  }
  static void run_pair(const kvserve::Q8Act& x, int64_t r0, const uint8_t* s, int64_t bytes, float* o, int64_t ldo,
                       const uint8_t* /*relaid: null, kRelays false*/) {
    pair_q8_0<R>(x, r0, s, bytes, o, ldo);
  }
};

// Q8Act::kq from Q8Act::k8 (blocks in k8_order): each 256 in transpose_k's order.
void transpose_codes_k(const int8_t* k8, int8_t* kq, int64_t n) {
  for (int64_t o = 0; o < n; o += 256) {
    __m256i v[8], t[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k8 + o + 32 * k8_order(j)));
    transpose_k(v, t);
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(kq + o + 32 * j), t[j]);
  }
}

// The activation quantizer's pieces, vectorized (the same fp32 operations as the scalar loop
// in Q8Act::quantize, so the same codes).
inline float amax_avx2(const float* x, int64_t n) {  // max |x[i]|, n a multiple of 8
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 codes round-half-even(x * id) clamped to [-127, 127] into q8; the
// sums of the first and the last 16 into sums.
inline void codes32_avx2(const float* xb, float id, int8_t* q8, int32_t* sums) {
  const __m256 idv = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)  // round half to even, as nearbyint in the default rounding mode
    q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), idv),
                                                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8), bytes);
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1));
  const __m256i ones = _mm256_set1_epi16(1);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(sums), hsum2_epi32(_mm256_madd_epi16(w0, ones), _mm256_madd_epi16(w1, ones)));
}

// From how many rows AVX2-only CPUs run Q4_1 / Q5_0 strip pairs in ymm (pair8_nibbles), against
// strip_nibbles' passes of 16 rows (one thread, SmolLM2's matrices, interleaved min-of-24 on a Zen
// 3): Q4_1 at 512 rows 1.08-1.28x, at 64 1.07-1.12x, but at 16 rows 1.00-1.07x and Q5_0 there
// 0.94-1.00x, at 4 rows both 0.90-0.97x (the re-lay's stores and loads). So prefill only: decode
// steps (up to 16 rows) keep strip_nibbles.
constexpr int64_t kPair8MinRows = 17;

// Strips [s0, s1): strip s writes columns s * 8 .. of out. Rows go in passes of Kernel::kMaxRows,
// then 8, 4, 2, 1 (each row's result does not depend on the pass it is in). On AVX512-VNNI
// CPUs two adjacent full strips go together (Kernel::run_pair, passes of 8 rows, then 4, 2, 1).
// On AVX2 alone, from kPair8MinRows rows, Q4_1 / Q5_0's full strip pairs go together in ymm
// (pair8_nibbles, passes of 4 rows, then 2, 1).
template <template <int> class Kernel>
void strips_q8(const kvserve::Q8Act& x, const uint8_t* w, int64_t strip_bytes, int64_t s0, int64_t s1, int64_t N,
               float* out, int64_t ldo) {
  constexpr int kMax = Kernel<1>::kMaxRows;
  static_assert(kMax == 8 || kMax == 16, "passes of 16 or 8 rows, then halving");
  const bool pairs = cpu_has_vnni();
  // AVX2 alone, prefill-sized calls: the full strip pairs in ymm (Kernel::run_pair8)
  const bool pairs8 = Kernel<1>::kPairs8 && !pairs && x.M >= kPair8MinRows;
  // the paired strips [s0, pair_end): the full ones (only the matrix's last strip can be
  // partial), an even count
  const int64_t pair_end = pairs || pairs8 ? s0 + (std::min(s1, N / kStrip) - s0) / 2 * 2 : s0;
  // AMX CPUs, from kAmxStripMinRows rows: the pairs' whole 16-row tiles on tiles (quant_linear_amx.cpp), the same floats
  const int64_t tiled = pairs && pair_end > s0 ? kvserve::strip_pairs_amx(x, w, Kernel<1>::kFormat, strip_bytes, s0, pair_end, out, ldo) : 0;
  for (int64_t s = s0; s < s1;) {
    const uint8_t* strip = w + s * strip_bytes;
    if constexpr (Kernel<1>::kPairs8) {
      if (pairs8 && s < pair_end) {
        thread_local std::vector<StripPair8> relaid8;
        Kernel<1>::relay_pair8(strip, strip_bytes, x.K / kBlock, relaid8);
        row_passes<4, 2, 1>(0, x.M, [&](auto rows, int64_t r) {
          Kernel<decltype(rows)::value>::run_pair8(x, r, relaid8.data(), out + r * ldo + s * kStrip, ldo);
        });
        s += 2;
        continue;
      }
    }
    if (s < pair_end) {
      // nibble formats, more than two passes: the pair re-laid once for all of them (relay_all;
      // for two, storing and loading the re-laid blocks measured slower than re-laying them: Q4_1
      // 16 rows +6-8%). Q8_0's passes load their k-quads as they are (Kernel::kRelays false).
      const uint8_t* relaid = nullptr;
      if constexpr (Kernel<1>::kRelays) {
        thread_local std::vector<uint8_t> relay_buffer;
        if (x.M - tiled > 16) {
          Kernel<1>::relay_pair(strip, strip_bytes, x.K / kBlock, relay_buffer);
          relaid = relay_buffer.data();
        }
      }
      row_passes<8, 4, 2, 1>(tiled, x.M, [&](auto rows, int64_t r) {
        Kernel<decltype(rows)::value>::run_pair(x, r, strip, strip_bytes, out + r * ldo + s * kStrip, ldo, relaid);
      });
      s += 2;
      continue;
    }
    const int64_t cols = std::min(kStrip, N - s * kStrip);
    const auto pass = [&](auto rows, int64_t r) {
      Kernel<decltype(rows)::value>::run(x, r, strip, out + r * ldo + s * kStrip, ldo, cols);
    };
    if constexpr (kMax == 16) row_passes<16, 8, 4, 2, 1>(0, x.M, pass);
    else row_passes<8, 4, 2, 1>(0, x.M, pass);
    ++s;
  }
}

#pragma GCC pop_options

// ---- Per-32 activations on AVX-512 (the VNNI CPUs): Q8Act's kBlocks layout of one row, 16 blocks
// at a time. The block-at-a-time AVX2 path (codes32_avx2) spent ~35 ns a block (SmolLM2's 16-row
// decode step quantizes ~49,000 blocks on each thread, ~1.7 ms), most of it on two horizontal
// reductions and two scalar divisions in one dependent chain. Here the 16 blocks' maxima and code
// sums fold together (fold16), and their scales divide in one vector. The float operations are
// the AVX2 path's (d = amax / 127, id = 1 / d, round-half-even(x id) clamped in fp32), so the
// codes, d and s are the same bit for bit.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")

// Lane i of the result: v[i]'s 16 lanes folded by op (max, +), for 16 vectors (v is clobbered).
// Four levels of pairwise folds halve the vectors; the last permutation puts the lanes in order.
template <typename Op>
inline __m512 fold16(__m512* v, Op op) {
  for (int i = 0; i < 8; ++i)  // quarters [v_i 0+2, v_i 1+3, v_i+8 0+2, v_i+8 1+3]
    v[i] = op(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: v_i, v_i+8, v_i+4, v_i+12 (4 lanes each)
    v[i] = op(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88), _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter q: 2 lanes of b_i's vector, 2 of b_i+2's
    v[i] = op(_mm512_shuffle_ps(v[i], v[i + 2], 0x44), _mm512_shuffle_ps(v[i], v[i + 2], 0xEE));
  const __m512 r = op(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  // r holds vectors [0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15]; the permutation is its own inverse
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), r);
}

// nb blocks of 32 floats at x -> codes q [32 nb], scales d [nb], d * (sum of the block's codes) s [nb].
void quantize_blocks_zmm(const float* x, int64_t nb, int8_t* q, float* d, float* s) {
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const auto fmax = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto iadd = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, nb - b0));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    __m512 v[16];
    for (int i = 0; i < 16; ++i) {
      const float* xb = x + (b0 + i) * kBlock;
      v[i] = i < n ? _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_abs_ps(_mm512_loadu_ps(xb + 16)))
                   : _mm512_setzero_ps();
    }
    const __m512 dg = _mm512_div_ps(fold16(v, fmax), _mm512_set1_ps(127.f));
    const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dg, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.f), dg);
    alignas(64) float ids[16];
    _mm512_store_ps(ids, id);
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {
        v[i] = _mm512_setzero_ps();
        continue;
      }
      const float* xb = x + (b0 + i) * kBlock;
      const __m512 idv = _mm512_set1_ps(ids[i]);
      __m512i c[2];
      for (int h = 0; h < 2; ++h) {  // round half to even, clamp in fp32, then to int32 (as codes32_avx2)
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[h] = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (b0 + i) * kBlock + 16 * h), _mm512_cvtsepi32_epi8(c[h]));
      }
      // the stored bytes' sum (saturated as vpmovsdb stores them)
      const __m512i m128 = _mm512_set1_epi32(-128);
      v[i] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_max_epi32(c[0], m128), _mm512_max_epi32(c[1], m128)));
    }
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_castps_si512(fold16(v, iadd)));
    _mm512_mask_storeu_ps(d + b0, valid, dg);
    _mm512_mask_storeu_ps(s + b0, valid, _mm512_mul_ps(dg, sums));
  }
}

#pragma GCC pop_options
#endif

// x [M, K] fp32, packed strips [ceil(N / 8), ...] -> [M, N] fp32 through int8 activations;
// callers check gguf_q8_supported(format) first (engine/loader/gguf/blocks.py BlockLinear).
// The arguments of the int8 ops: x [M, K] fp32 and `packed` holding N x K weights of `format`,
// which has an int8 kernel on this CPU.
void check_q8_args(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format) {
  TORCH_CHECK(kvserve::q8_supported(format), "no int8-activation kernel for format ", format, " on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t K = x.size(1);
  const bool strips = is_strip_format(format);
  const int64_t per = block_weights(format), width = K / per * block_bytes(format);
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
  if (is_strip_format(format)) {  // strips of kStrip features
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

// The activation quantization alone, for tests: (codes int8 [M, K], scales fp32 [M, K / block]),
// per 32 (the strip formats' activations) or per 256 (the K-quants').
std::tuple<at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(block == kBlock || block == 256, "block must be 32 or 256");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % block == 0,
              "x must be a 2-D float32 tensor whose width is a multiple of ", block);
  const int64_t M = x.size(0), K = x.size(1);
  const auto xc = x.contiguous();
  kvserve::Q8Act q;
  q.quantize(xc.data_ptr<float>(), M, K, block == kBlock ? kvserve::Q8Act::kBlocks : kvserve::Q8Act::kSuper);
  const auto& d_v = block == kBlock ? q.d : q.kd;
  at::Tensor codes = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, K / block}, x.options());
  int8_t* c = codes.data_ptr<int8_t>();
  if (block == kBlock)
    std::copy(q.q8.begin(), q.q8.end(), c);
  else  // k8 back to natural order
    for (int64_t o = 0; o < M * K; o += 256)
      for (int j = 0; j < 8; ++j) std::memcpy(c + o + 32 * j, q.k8.data() + o + 32 * k8_order(j), 32);
  std::copy(d_v.begin(), d_v.end(), d.data_ptr<float>());
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

// Whether the K-quants' many-row int8 matmul takes AMX tiles here (quant_linear_amx.cpp).
bool gguf_q8_amx() { return kvserve::cpu_has_amx(); }

}  // namespace

void kvserve::Q8Act::quantize(const float* x, int64_t rows, int64_t width, unsigned layouts) {
  M = rows, K = width;
  if (layouts & kOffset) layouts |= kBlocks;
  const bool avx2 = cpu_has_avx2(), blocks = layouts & kBlocks, super = layouts & kSuper;
#ifdef KVSERVE_X86
  const bool zmm = cpu_has_vnni();  // AVX-512 F, BW, VL: quantize_blocks_zmm
#endif
  TORCH_CHECK(K % kBlock == 0 && (!super || K % 256 == 0), "cannot quantize a width of ", K, " per 32 / 256");
  q8.resize(blocks ? M * K : 0), d.resize(blocks ? M * K / kBlock : 0), s.resize(d.size());
  u8.resize(avx2 && (layouts & kOffset) && cpu_has_vnni() ? M * K : 0);
  k8.resize(super ? M * K : 0), ksum16.resize(super ? M * K / 16 : 0), kd.resize(super ? M * K / 256 : 0);
  kq.resize(avx2 && super ? M * K : 0);
  // n values at xb -> scale, codes, sums of each 16 codes; per 32 or per 256.
  // The codes of 32-block c go to codes + 32 * (permuted ? k8_order(c) : c); sums stay in order.
  const auto group = [&](const float* xb, int64_t n, float& dg, int8_t* codes, int32_t* sums, bool permuted) {
    const auto at = [&](int64_t c) { return codes + kBlock * (permuted ? k8_order(static_cast<int>(c)) : c); };
#ifdef KVSERVE_X86
    if (avx2) {
      dg = amax_avx2(xb, n) / 127.f;
      const float id = dg > 0.f ? 1.f / dg : 0.f;
      for (int64_t o = 0; o < n; o += kBlock)
        codes32_avx2(xb + o, id, at(o / kBlock), sums + o / 16);
      return;
    }
#endif
    float amax = 0.f;
    for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(xb[k]));
    dg = amax / 127.f;
    const float id = dg > 0.f ? 1.f / dg : 0.f;
    for (int64_t k = 0; k < n; ++k) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[k] * id)));
      at(k / kBlock)[k % kBlock] = static_cast<int8_t>(v);
      sums[k / 16] = (k % 16 ? sums[k / 16] : 0) + static_cast<int32_t>(v);
    }
  };
  // rows [r0, r1): each row's layouts depend on that row alone
  const auto rows_range = [&](int64_t r0, int64_t r1) {
    int32_t sums[16];
    for (int64_t r = r0; r < r1; ++r) {
#ifdef KVSERVE_X86
      if (blocks && zmm) {
        quantize_blocks_zmm(x + r * K, K / kBlock, q8.data() + r * K, d.data() + r * K / kBlock, s.data() + r * K / kBlock);
      } else
#endif
      if (blocks)
        for (int64_t b = r * K / kBlock; b < (r + 1) * K / kBlock; ++b) {
          group(x + b * kBlock, kBlock, d[b], q8.data() + b * kBlock, sums, false);
          s[b] = d[b] * static_cast<float>(sums[0] + sums[1]);
        }
      if (super)
        for (int64_t b = r * K / 256; b < (r + 1) * K / 256; ++b) {
          group(x + b * 256, 256, kd[b], k8.data() + b * 256, sums, true);
          for (int i = 0; i < 16; ++i) ksum16[b * 16 + i] = static_cast<int16_t>(sums[i]);  // |.| <= 16 * 127
        }
    }
#ifdef KVSERVE_X86
    if (!kq.empty()) transpose_codes_k(k8.data() + r0 * K, kq.data() + r0 * K, (r1 - r0) * K);
#endif
    for (int64_t i = r0 * K; i < static_cast<int64_t>(u8.size()) && i < r1 * K; ++i)
      u8[i] = static_cast<uint8_t>(q8[i]) ^ 0x80;  // x + 128
  };
  // Prefill-sized inputs on ATen's threads (inside the native layer's OpenMP region, where each
  // thread quantizes its own copy, parallel_for runs inline).
  if (M * K >= (1 << 16))
    at::parallel_for(0, M, 1, rows_range);
  else
    rows_range(0, M);
  if (super && (layouts & kTiles) && M >= kAmxMinRows && cpu_has_amx())
    fill_tiles();
  else
    kt.clear(), ktd.clear(), ktsum.clear();
}

unsigned kvserve::q8_layouts(int64_t format) {
  if (!q8_supported(format)) return 0;
  switch (format) {
    case kQ8_0: return cpu_has_vnni() ? Q8Act::kOffset : Q8Act::kBlocks;  // pairs (and lone strips) | strips
    case kQ4_K: case kQ5_K: case kQ6_K: return Q8Act::kSuper | (cpu_has_amx() ? Q8Act::kTiles : 0u);
    default: return Q8Act::kBlocks;  // Q4_1, Q5_0 and the row formats: the codes, scales and block sums
  }
}

bool kvserve::q8_supported(int64_t format) {
  return format >= kQ4_1 && format <= kQ5_1 && cpu_has_avx2();  // every quantized BlockFormat (not F16, BF16)
}

void kvserve::gguf_linear_q8_range(const Q8Act& x, const uint8_t* w, int64_t N, int64_t format, int64_t n0,
                                   int64_t n1, float* out, int64_t ldo) {
  if (n1 <= n0 || x.M == 0) return;
  TORCH_CHECK(q8_supported(format), "no int8-activation kernel for format ", format, " on this CPU");
#ifdef KVSERVE_X86
  if (format == kQ4_K) return rows_q8_all<Q4_KRows>(x, w, n0, n1, out - n0, ldo);
  if (format == kQ5_K) return rows_q8_all<Q5_KRows>(x, w, n0, n1, out - n0, ldo);
  if (format == kQ6_K) return rows_q8_all<Q6_KRows>(x, w, n0, n1, out - n0, ldo);
  if (format == kQ4_0) return legacy_rows_all<kQ4_0>(x, w, n0, n1, out - n0, ldo);
  if (format == kQ5_1) return legacy_rows_all<kQ5_1>(x, w, n0, n1, out - n0, ldo);
  const int64_t s0 = n0 / kStrip, s1 = (n1 + kStrip - 1) / kStrip, n_end = std::min(n1, N);
  // strips_q8 writes strip s at out + s * 8: shift out so feature n0 lands at out[0]
  if (format == kQ4_1)
    strips_q8<Q4_1Kernel>(x, w, x.K / kBlock * kQ4_1Bytes, s0, s1, n_end, out - n0, ldo);
  else if (format == kQ5_0)
    strips_q8<Q5_0Kernel>(x, w, x.K / kBlock * kQ5_0Bytes, s0, s1, n_end, out - n0, ldo);
  else
    strips_q8<Q8_0Kernel>(x, w, x.K / kBlock * kQ8_0Bytes, s0, s1, n_end, out - n0, ldo);
#endif
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_q8_supported(int format) -> bool", &gguf_q8_supported);
  m.def("gguf_q8_isa() -> str", &gguf_q8_isa);
  m.def("gguf_q8_amx() -> bool", &gguf_q8_amx);
  m.def("gguf_linear_q8(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
  m.def("gguf_swiglu_q8(Tensor x, Tensor packed, int intermediate, int format) -> Tensor");
  m.def("quantize_q8(Tensor x, int block=32) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_linear_q8", &gguf_linear_q8);
  m.impl("gguf_swiglu_q8", &gguf_swiglu_q8);
  m.impl("quantize_q8", &quantize_q8);
}
