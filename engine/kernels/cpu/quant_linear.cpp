// Linear layers computed from GGUF-quantized weights without a dense copy: y[M, N] = x[M, K] @ W^T
// in fp32. Q4_1, Q5_0 and Q8_0 run on strips (below); Q4_0, Q5_1, Q4_K, Q5_K and Q6_K on GGUF's own
// rows ("Row formats"). Calls of many rows can run gguf_linear_panels (decoded tiles + GEMM), and
// gguf_rows is an embedding lookup from blocks. See engine/loader/gguf/blocks.py for when kvserve uses them.
//
// Decode streams every weight once per step, so its speed is set by weight bytes: Q4_1 is
// 0.625 bytes a weight against fp32's 4. Weights are expanded to fp32 in registers exactly as
// gguf dequantizes them (Q4_1: d * q + m, Q8_0: d * q, d an fp16 scale and q a small integer,
// so d * q is exact in fp32 and the values equal the dense checkpoint's bit for bit), then
// multiplied by the activations in fp32: the result differs from F.linear on the dequantized
// matrix only in summation order.
//
// Packed layout. gguf_pack regroups GGUF's rows of blocks into strips of 8 output columns:
// strip s, block b holds the 8 columns' scales (fp16) and then their codes k-major, so one
// 8-lane vector is "8 columns at one k". The kernel walks a strip once per group of up to 8
// rows: per k it expands one vector and feeds one FMA per row with x[row, k] broadcast; the
// accumulators are the outputs themselves. Same bytes as GGUF, no transposes at run time.
//   Q4_1 strip-block (160 bytes): d[8] fp16, m[8] fp16, then 4 chunks of 32 bytes; in chunk
//        o, byte 4c + e holds column c at k = 8o + e (low nibble) and k = 8o + 4 + e (high
//        nibble). So a chunk's low nibbles are k-quad 2o of the 8 columns, one dword a column,
//        and its high nibbles k-quad 2o + 1: the operand of an int8 dot product (vpdpbusd, an
//        AMX B tile) after one mask or shift, with no byte shuffles (kvserve::nibble_quads).
//   Q8_0 strip-block (272 bytes): d[8] fp16, then int8 codes in k-quads: byte 32j + 4c + e =
//        column c at k = 4j + e (j = 0 .. 7), so 32 bytes are k-quad j of the 8 columns, one dword
//        a column, as the int8 kernels take them (no re-lay).
//   Q5_0 strip-block (176 bytes): d[8] fp16, Q4_1's chunks of nibbles, 32 bytes of fifth bits.
// Columns past N in the last strip are zero.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "block_codes.h"
#include "cpu_features.h"  // KVSERVE_X86, cpu_has_avx2
#include "quant_linear.h"
#include "vec_math.h"      // hsum8

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block (along K), both formats
constexpr int64_t kStrip = 8;   // output columns per strip
constexpr int kMaxRows = 8;     // rows per pass over a strip

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Where a strip-block's nibble of column c at k sits (Q4_1, Q5_0): byte nibble_byte(k, c) of
// the nibbles, shifted by nibble_shift(k) (the layout above).
constexpr int nibble_byte(int k, int c) { return 32 * (k / 8) + 4 * c + k % 4; }
constexpr int nibble_shift(int k) { return k % 8 < 4 ? 0 : 4; }
// Where a Q8_0 strip-block's code of column c at k sits: byte quad_byte(k, c) of the codes.
constexpr int quad_byte(int k, int c) { return 32 * (k / 4) + 4 * c + k % 4; }

struct Q4_1 {
  static constexpr int64_t kGgufBytes = 20;   // half d, half m, 16 bytes of nibbles
  static constexpr int64_t kStripBytes = kvserve::blocks::kQ4_1StripBytes;
  // GGUF block: weight j is the low nibble of byte j, weight j + 16 its high nibble.
  static int gguf_code(const uint8_t* blk, int j) { return j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4; }
  static void pack(const uint8_t* const cols[kStrip], uint8_t* dst) {
    std::memset(dst, 0, kStripBytes);
    for (int c = 0; c < kStrip; ++c) {
      if (!cols[c]) continue;
      std::memcpy(dst + 2 * c, cols[c], 2);
      std::memcpy(dst + 16 + 2 * c, cols[c] + 2, 2);
      for (int k = 0; k < kBlock; ++k) dst[32 + nibble_byte(k, c)] |= gguf_code(cols[c], k) << nibble_shift(k);
    }
  }
  // w[k][c] = the strip-block's weight at (k, column c), as gguf computes it: d * q + m.
  static void expand(const uint8_t* sb, float w[kBlock][kStrip]) {
    float d[kStrip], m[kStrip];
    for (int c = 0; c < kStrip; ++c) d[c] = half_at(sb + 2 * c), m[c] = half_at(sb + 16 + 2 * c);
    for (int k = 0; k < kBlock; ++k)
      for (int c = 0; c < kStrip; ++c)
        w[k][c] = d[c] * static_cast<float>(sb[32 + nibble_byte(k, c)] >> nibble_shift(k) & 15) + m[c];
  }
};

struct Q8_0 {
  static constexpr int64_t kGgufBytes = 34;  // half d, 32 int8 codes
  static constexpr int64_t kStripBytes = kvserve::blocks::kQ8_0StripBytes;
  static void pack(const uint8_t* const cols[kStrip], uint8_t* dst) {
    std::memset(dst, 0, kStripBytes);
    for (int c = 0; c < kStrip; ++c) {
      if (!cols[c]) continue;
      std::memcpy(dst + 2 * c, cols[c], 2);
      for (int k = 0; k < kBlock; ++k) dst[16 + quad_byte(k, c)] = cols[c][2 + k];
    }
  }
  static void expand(const uint8_t* sb, float w[kBlock][kStrip]) {
    float d[kStrip];
    for (int c = 0; c < kStrip; ++c) d[c] = half_at(sb + 2 * c);
    for (int k = 0; k < kBlock; ++k)
      for (int c = 0; c < kStrip; ++c) w[k][c] = d[c] * static_cast<float>(static_cast<int8_t>(sb[16 + quad_byte(k, c)]));
  }
};

// Q5_0 (w = d (q - 16), q five bits): the nibbles as Q4_1's (at byte 16, no m), then the fifth
// bits at byte 144: bit 2o of byte 144 + j is the fifth bit of chunk o's byte j's low nibble,
// bit 2o + 1 of its high nibble, so that one shift of those 32 bytes serves a whole chunk
// (block_codes.h nibble_quads).
// 176 bytes a strip-block: the GGUF blocks' own 8 x 22.
struct Q5_0 {
  static constexpr int64_t kGgufBytes = 22;  // half d, 4 bytes of fifth bits qh, 16 bytes of nibbles
  static constexpr int64_t kStripBytes = kvserve::blocks::kQ5_0StripBytes;
  // GGUF block: weight j's nibble as Q4_1's, its fifth bit bit j of qh.
  static int gguf_code(const uint8_t* blk, int j) {
    const int nibble = j < 16 ? blk[6 + j] & 15 : blk[6 + j - 16] >> 4;
    return nibble | static_cast<int>((kvserve::u32_at(blk + 2) >> j) & 1) << 4;
  }
  static void pack(const uint8_t* const cols[kStrip], uint8_t* dst) {
    std::memset(dst, 0, kStripBytes);
    for (int c = 0; c < kStrip; ++c) {
      if (!cols[c]) continue;
      std::memcpy(dst + 2 * c, cols[c], 2);
      for (int k = 0; k < kBlock; ++k) {
        const int code = gguf_code(cols[c], k), j = nibble_byte(k, c) % 32;
        dst[16 + nibble_byte(k, c)] |= (code & 15) << nibble_shift(k);
        dst[144 + j] |= (code >> 4) << (2 * (k / 8) + nibble_shift(k) / 4);
      }
    }
  }
  static void expand(const uint8_t* sb, float w[kBlock][kStrip]) {
    float d[kStrip];
    for (int c = 0; c < kStrip; ++c) d[c] = half_at(sb + 2 * c);
    for (int k = 0; k < kBlock; ++k)
      for (int c = 0; c < kStrip; ++c) {
        const int nibble = sb[16 + nibble_byte(k, c)] >> nibble_shift(k) & 15;
        const int fifth = sb[144 + nibble_byte(k, c) % 32] >> (2 * (k / 8) + nibble_shift(k) / 4) & 1;
        w[k][c] = d[c] * static_cast<float>((nibble | fifth << 4) - 16);
      }
  }
};

// Portable path: each strip-block expanded to fp32 on the stack, then plain loops.
template <typename Format>
void linear_strips_portable(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t s0, int64_t s1,
                            float* out, int64_t N, int64_t ldo) {
  const int64_t strip_bytes = K / kBlock * Format::kStripBytes;
  float wb[kBlock][kStrip];
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t cols = std::min(kStrip, N - s * kStrip);
    for (int64_t r = 0; r < M; ++r) {
      float acc[kStrip] = {};
      for (int64_t b = 0; b < K / kBlock; ++b) {
        Format::expand(w + s * strip_bytes + b * Format::kStripBytes, wb);
        const float* xb = x + r * K + b * kBlock;
        for (int k = 0; k < kBlock; ++k)
          for (int c = 0; c < kStrip; ++c) acc[c] += xb[k] * wb[k][c];
      }
      std::copy(acc, acc + cols, out + r * ldo + s * kStrip);
    }
  }
}

#ifdef KVSERVE_X86
// The AVX2 path, compiled for AVX2 + FMA + F16C whatever -march says and taken only when
// the CPU running it has them (see has_avx2), so a generic build is fast on modern x86.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <typename Format>
struct Avx2;

// fn(k, w): w = the strip-block's 8 columns at k, for k = 0 .. 31 in order. Q4_1 and Q5_0 (m =
// -16 d: d q - 16 d = d (q - 16) exactly): chunk o's k-quads (block_codes.h nibble_quads) give
// k = 8o + e as byte e of each column's dword.
template <bool kQ5>
struct Avx2Nibbles {
  template <typename Fn>
  static inline void for_each_k(const uint8_t* sb, Fn&& fn) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
    const __m256 m = kQ5 ? _mm256_mul_ps(d, _mm256_set1_ps(-16.f))
                         : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16)));
    const __m256i byte = _mm256_set1_epi32(0xff);
    for (int o = 0; o < 4; ++o) {
      __m256i quad[2];
      kvserve::nibble_quads<kQ5>(sb + (kQ5 ? 16 : 32), sb + 144, o, quad[0], quad[1]);
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 4; ++e) {
          const __m256i q = _mm256_and_si256(_mm256_srli_epi32(quad[h], 8 * e), byte);
          fn(8 * o + 4 * h + e, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m));
        }
    }
  }
};

template <>
struct Avx2<Q4_1> : Avx2Nibbles<false> {};
template <>
struct Avx2<Q5_0> : Avx2Nibbles<true> {};

template <>
struct Avx2<Q8_0> {
  template <typename Fn>
  static inline void for_each_k(const uint8_t* sb, Fn&& fn) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
    for (int j = 0; j < 8; ++j) {  // k-quad j: k = 4j + e is byte e of each column's dword, sign-extended
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * j));
      for (int e = 0; e < 4; ++e)
        fn(4 * j + e, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * e), 24))));
    }
  }
};

// Rows [0, R) of x against one strip: out[r * ldo + c] for c < cols. With few rows, each
// row keeps A accumulators (k rotates over them) so the FMA chains are independent enough
// to hide their latency.
template <typename Format, int R>
void strip_rows(const float* x, int64_t K, const uint8_t* strip, float* out, int64_t ldo, int64_t cols) {
  constexpr int A = R == 1 ? 4 : R <= 3 ? 2 : 1;
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    kvserve::prefetch_ahead(strip + b * Format::kStripBytes, Format::kStripBytes);
    Avx2<Format>::for_each_k(strip + b * Format::kStripBytes, [&](int k, __m256 w) {
      for (int r = 0; r < R; ++r) acc[r][k % A] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + r * K + k), w, acc[r][k % A]);
    });
  }
  for (int r = 0; r < R; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
    if (cols == kStrip) {
      _mm256_storeu_ps(out + r * ldo, s);
    } else {
      alignas(32) float tmp[kStrip];
      _mm256_store_ps(tmp, s);
      std::copy(tmp, tmp + cols, out + r * ldo);
    }
  }
}

template <typename Format>
void linear_strips_avx2(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t s0, int64_t s1,
                        float* out, int64_t N, int64_t ldo) {
  const int64_t strip_bytes = K / kBlock * Format::kStripBytes;
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* strip = w + s * strip_bytes;
    const int64_t cols = std::min(kStrip, N - s * kStrip);
    for (int64_t r = 0; r < M; r += kMaxRows) {
      const float* xr = x + r * K;
      float* o = out + r * ldo + s * kStrip;
      switch (std::min<int64_t>(kMaxRows, M - r)) {
        case 8: strip_rows<Format, 8>(xr, K, strip, o, ldo, cols); break;
        case 7: strip_rows<Format, 7>(xr, K, strip, o, ldo, cols); break;
        case 6: strip_rows<Format, 6>(xr, K, strip, o, ldo, cols); break;
        case 5: strip_rows<Format, 5>(xr, K, strip, o, ldo, cols); break;
        case 4: strip_rows<Format, 4>(xr, K, strip, o, ldo, cols); break;
        case 3: strip_rows<Format, 3>(xr, K, strip, o, ldo, cols); break;
        case 2: strip_rows<Format, 2>(xr, K, strip, o, ldo, cols); break;
        default: strip_rows<Format, 1>(xr, K, strip, o, ldo, cols); break;
      }
    }
  }
}

#pragma GCC pop_options
#endif


// ---- Row formats: GGUF's own layout, one row of blocks per output feature, used as stored
// (no repacking). decode(block, y) writes the block's weights exactly as gguf's dequantize
// computes them: Q4_0 d * (q - 8); Q4_K / Q5_K (d * sc) * q - dmin * m; Q6_K (d * sc) * (q - 32).
// Every product there is exact in fp32 (an fp16 d has 11 significant bits, sc at most 7, q at
// most 6), so only the final subtraction rounds, the same once whatever the evaluation order
// (an FMA included): the AVX2 decoders below equal the portable ones bit for bit.

inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

struct Q4_0 {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((b[2 + j] & 15) - 8);
      y[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
    }
  }
};

// Q5_1: 32 fifth bits in a little-endian uint32 before the nibbles; d * q + m. (Q5_0 runs on
// strips, above.)
using kvserve::u32_at;  // block_codes.h

struct Q5_1 {
  static constexpr int64_t kWeights = 32, kBytes = 24;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((b[8 + j] & 15) | (((qh >> j) & 1) << 4)) + m;
      y[j + 16] = d * static_cast<float>((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
  }
};

// Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles; Q5_K (kQ5) the same with 32
// bytes of fifth bits before the nibbles. (d sc) q - dmin m per sub-block of 32.
template <bool kQ5>
struct KQuant45 {
  static constexpr int64_t kWeights = 256, kBytes = kQ5 ? 176 : 144;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* qh = b + 16;  // Q5_K's fifth bits
    const uint8_t* q = b + (kQ5 ? 48 : 16);
    for (int c = 0; c < 4; ++c, q += 32, y += 64) {
      int sc0, m0, sc1, m1;
      k_scale_min(b + 4, 2 * c, sc0, m0);
      k_scale_min(b + 4, 2 * c + 1, sc1, m1);
      const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
      for (int l = 0; l < 32; ++l) {
        const int h0 = kQ5 ? ((qh[l] >> (2 * c)) & 1) << 4 : 0, h1 = kQ5 ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
        y[l] = d0 * static_cast<float>((q[l] & 15) | h0) - o0;
        y[l + 32] = d1 * static_cast<float>((q[l] >> 4) | h1) - o1;
      }
    }
  }
};
using Q4_K = KQuant45<false>;
using Q5_K = KQuant45<true>;

struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;  // 128 bytes low nibbles, 64 of high pairs, 16 int8 scales, d
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h, y += 128) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h);
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        y[l] = d * sc[is] * static_cast<float>(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
        y[l + 32] = d * sc[is + 2] * static_cast<float>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = d * sc[is + 4] * static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = d * sc[is + 6] * static_cast<float>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
};

// F16 / BF16: not quantized; a row is K halves, read 32 (64 bytes) at a time so they ride the
// row-format code as blocks of 32. Both widen to fp32 exactly (BF16 is fp32's top 16 bits).
struct F16 {
  static constexpr int64_t kWeights = 32, kBytes = 64;
  static void decode(const uint8_t* b, float* y) {
    for (int j = 0; j < 32; ++j) y[j] = half_at(b + 2 * j);
  }
};

struct BF16 {
  static constexpr int64_t kWeights = 32, kBytes = 64;
  static void decode(const uint8_t* b, float* y) {
    for (int j = 0; j < 32; ++j) {
      uint16_t h;
      std::memcpy(&h, b + 2 * j, sizeof(h));
      y[j] = c10::detail::f32_from_bits(h);
    }
  }
};

// Blocks the portable path decodes per chunk: the 32-weight formats up to 8 at a time so the
// accumulators are reloaded once per 256 weights, like the K formats.
template <typename Format>
constexpr int64_t chunk_blocks() { return Format::kWeights == 32 ? 8 : 1; }

// Portable path: decode a chunk into y, then plain dot products.
template <typename Format>
void linear_rows_portable(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                          float* out, int64_t ldo) {
  const int64_t nb = K / Format::kWeights;
  float y[256];
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < nb; b += chunk_blocks<Format>()) {
      const int64_t cnt = std::min(chunk_blocks<Format>(), nb - b), len = cnt * Format::kWeights;
      for (int64_t i = 0; i < cnt; ++i) Format::decode(w + (n * nb + b + i) * Format::kBytes, y + i * Format::kWeights);
      for (int64_t r = 0; r < M; ++r) {
        const float* xr = x + r * K + b * Format::kWeights;
        float s = 0.f;
        for (int64_t k = 0; k < len; ++k) s += y[k] * xr[k];
        acc[r] += s;
      }
    }
    for (int64_t r = 0; r < M; ++r) out[r * ldo + n] = acc[r];
  }
}

#ifdef KVSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// The decoders hand each 8 weights, as a vector, to a sink: sink(o, w) with w the block's
// weights o .. o + 7. Store writes them out (decode); the fused matmul FMAs them straight into
// its accumulators, so a weight never makes the round trip through memory.
struct Store {
  float* y;
  void operator()(int o, __m256 w) const { _mm256_storeu_ps(y + o, w); }
};

// weights o .. o + 15 = D * codes + off for 16 uint8 codes.
template <typename Sink>
inline void store16(Sink& sink, int o, __m128i codes, __m256 D, __m256 off) {
  sink(o, _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), off));
  sink(o + 8, _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))), off));
}

template <typename Sink>
inline void store32(Sink& sink, int o, __m256i codes, __m256 D, __m256 off) {
  store16(sink, o, _mm256_castsi256_si128(codes), D, off);
  store16(sink, o + 16, _mm256_extracti128_si256(codes, 1), D, off);
}

template <typename Format>
struct Avx2Rows;

template <>
struct Avx2Rows<Q4_0> {
  template <typename Sink>
  static void run(const uint8_t* b, Sink& y) {
    const float d = half_at(b);
    const __m256 D = _mm256_set1_ps(d), off = _mm256_set1_ps(-8.f * d);  // d * q - 8 d = d * (q - 8) exactly
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), mask = _mm_set1_epi8(15);
    store16(y, 0, _mm_and_si128(q, mask), D, off);
    store16(y, 16, _mm_and_si128(_mm_srli_epi16(q, 4), mask), D, off);
  }
};

using kvserve::q5_codes;  // block_codes.h

template <>
struct Avx2Rows<Q5_1> {
  template <typename Sink>
  static void run(const uint8_t* b, Sink& y) {
    store32(y, 0, q5_codes(b + 4, b + 8), _mm256_set1_ps(half_at(b)), _mm256_set1_ps(half_at(b + 2)));
  }
};

// codes, and for Q5_K (kQ5) with bit `bit` of each byte of qh (the codes' fifth bits) at bit 4.
template <bool kQ5>
inline __m256i with_fifth(__m256i codes, __m256i qh, int bit) {
  if constexpr (kQ5) {
    const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(bit)), _mm256_set1_epi8(1));
    codes = _mm256_or_si256(codes, _mm256_slli_epi16(h, 4));
  }
  return codes;
}

// Q4_K, and Q5_K (kQ5: 32 bytes of fifth bits before the nibbles).
template <bool kQ5>
struct Avx2Rows<KQuant45<kQ5>> {
  template <typename Sink>
  static void run(const uint8_t* b, Sink& y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const __m256i mask = _mm256_set1_epi8(15);
    const __m256i qh = kQ5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      k_scale_min(b + 4, 2 * c, sc0, m0);
      k_scale_min(b + 4, 2 * c + 1, sc1, m1);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (kQ5 ? 48 : 16) + 32 * c));
      store32(y, 64 * c, with_fifth<kQ5>(_mm256_and_si256(q, mask), qh, 2 * c), _mm256_set1_ps(d * sc0),
              _mm256_set1_ps(-(dmin * m0)));
      store32(y, 64 * c + 32, with_fifth<kQ5>(_mm256_and_si256(_mm256_srli_epi16(q, 4), mask), qh, 2 * c + 1),
              _mm256_set1_ps(d * sc1), _mm256_set1_ps(-(dmin * m1)));
    }
  }
};

template <>
struct Avx2Rows<Q6_K> {
  // 32 codes whose first and last 16 have scales sc[0] and sc[1]: (d * sc) * q - 32 (d * sc), exact.
  template <typename Sink>
  static void store32s(Sink& y, int o, __m256i codes, float d, const int8_t* sc) {
    const float a = d * sc[0], b = d * sc[1];
    store16(y, o, _mm256_castsi256_si128(codes), _mm256_set1_ps(a), _mm256_set1_ps(-32.f * a));
    store16(y, o + 16, _mm256_extracti128_si256(codes, 1), _mm256_set1_ps(b), _mm256_set1_ps(-32.f * b));
  }
  template <typename Sink>
  static void run(const uint8_t* b, Sink& y) {
    const float d = half_at(b + 208);
    const __m256i mask = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h);
      auto hi = [&](int shift) {
        return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), three), 4);
      };
      store32s(y, 128 * h, _mm256_or_si256(_mm256_and_si256(l0, mask), hi(0)), d, sc);
      store32s(y, 128 * h + 32, _mm256_or_si256(_mm256_and_si256(l1, mask), hi(2)), d, sc + 2);
      store32s(y, 128 * h + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask), hi(4)), d, sc + 4);
      store32s(y, 128 * h + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask), hi(6)), d, sc + 6);
    }
  }
};

template <>
struct Avx2Rows<F16> {
  template <typename Sink>
  static void run(const uint8_t* b, Sink& y) {
    for (int o = 0; o < 32; o += 8) y(o, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * o))));
  }
};

template <>
struct Avx2Rows<BF16> {
  template <typename Sink>
  static void run(const uint8_t* b, Sink& y) {
    for (int o = 0; o < 32; o += 8) {
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * o)));
      y(o, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
  }
};

template <typename Format>
inline void decode_avx2(const uint8_t* b, float* y) {
  Store sink{y};
  Avx2Rows<Format>::run(b, sink);
}

using kvserve::hsum8;  // vec_math.h

// Up to 4 rows of x against output features [n0, n1), each 8 weights FMA'd into the rows'
// accumulators as soon as they are decoded (no round trip through memory): decode is about
// half the work per weight, and with few rows the store and reload of every decoded weight
// cost as much again. A accumulators per row (chosen by the weights' offset) so the FMA
// chains overlap.
template <typename Format, int R>
void rows_fused(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int A = R == 1 ? 4 : 2;
  const int64_t nb = K / Format::kWeights;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    const uint8_t* row = w + n * nb * Format::kBytes;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * Format::kWeights;
      auto sink = [&](int o, __m256 wv) {
        const int a = (o / 8) % A;
        for (int r = 0; r < R; ++r) acc[r][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xb + r * K + o), acc[r][a]);
      };
      kvserve::prefetch_ahead(row + b * Format::kBytes, Format::kBytes);
      Avx2Rows<Format>::run(row + b * Format::kBytes, sink);
    }
    for (int r = 0; r < R; ++r) {
      __m256 t = acc[r][0];
      for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[r][a]);
      out[r * ldo + n] = hsum8(t);
    }
  }
}

template <typename Format>
void decode_row_avx2(const uint8_t* row, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b) {
    kvserve::prefetch_ahead(row + b * Format::kBytes, Format::kBytes);
    decode_avx2<Format>(row + b * Format::kBytes, y + b * Format::kWeights);
  }
}

// Rows [0, R) of x against F decoded weight rows y (row stride K): out[r * ldo + f]. One
// accumulator per (row, feature) over all of K, so a step of 8 k loads R + F vectors for R * F
// FMAs, and a row's sums do not depend on the rows tiled with it.
template <int R, int F>
inline void tile_dot(const float* x, int64_t K, const float* y, float* out, int64_t ldo) {
  __m256 acc[R][F];
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) acc[r][f] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 yv[F];
    for (int f = 0; f < F; ++f) yv[f] = _mm256_loadu_ps(y + f * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int f = 0; f < F; ++f) acc[r][f] = _mm256_fmadd_ps(xv, yv[f], acc[r][f]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) out[r * ldo + f] = hsum8(acc[r][f]);
}

// All M rows of x against F decoded weight rows: tiles of 4 rows, then the rest.
template <int F>
void rows_against(const float* x, int64_t M, int64_t K, const float* y, float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) tile_dot<4, F>(x + r * K, K, y, out + r * ldo, ldo);
  switch (M - r) {
    case 3: return tile_dot<3, F>(x + r * K, K, y, out + r * ldo, ldo);
    case 2: return tile_dot<2, F>(x + r * K, K, y, out + r * ldo, ldo);
    case 1: return tile_dot<1, F>(x + r * K, K, y, out + r * ldo, ldo);
    default: return;
  }
}

// Output features [n0, n1). Up to 4 rows: rows_fused. More: two features at a time are decoded
// whole (2 K floats, in L1 or L2) and multiplied by the rows in tiles of 4 x 2 (tile_dot): 0.75
// loads an FMA, where a row at a time against one decoded feature took 2.
template <typename Format>
void linear_rows_avx2(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                      float* out, int64_t ldo) {
  switch (M) {
    case 1: return rows_fused<Format, 1>(x, K, w, n0, n1, out, ldo);
    case 2: return rows_fused<Format, 2>(x, K, w, n0, n1, out, ldo);
    case 3: return rows_fused<Format, 3>(x, K, w, n0, n1, out, ldo);
    case 4: return rows_fused<Format, 4>(x, K, w, n0, n1, out, ldo);
    default: break;
  }
  const int64_t nb = K / Format::kWeights, row_bytes = nb * Format::kBytes;
  std::vector<float> y(2 * K);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    decode_row_avx2<Format>(w + n * row_bytes, nb, y.data());
    decode_row_avx2<Format>(w + (n + 1) * row_bytes, nb, y.data() + K);
    rows_against<2>(x, M, K, y.data(), out + n, ldo);
  }
  if (n < n1) {
    decode_row_avx2<Format>(w + n * row_bytes, nb, y.data());
    rows_against<1>(x, M, K, y.data(), out + n, ldo);
  }
}

#pragma GCC pop_options
#endif

bool has_avx2() { return kvserve::cpu_has_avx2(); }

template <typename Format>
void linear_strips(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t s0, int64_t s1, float* out,
                   int64_t N, int64_t ldo) {
#ifdef KVSERVE_X86
  if (has_avx2()) return linear_strips_avx2<Format>(x, M, K, w, s0, s1, out, N, ldo);
#endif
  linear_strips_portable<Format>(x, M, K, w, s0, s1, out, N, ldo);
}

// Format codes (engine/loader/gguf/blocks.py BlockFormat): strips of 8 columns for 0, 1 and 6
// (kvserve::blocks::is_strip_format), GGUF rows for the others.
template <typename Fn>
auto with_format(int64_t format, Fn&& fn) {
  switch (format) {
    case 0: return fn(Q4_1{});
    case 1: return fn(Q8_0{});
    case 2: return fn(Q4_0{});
    case 3: return fn(Q4_K{});
    case 4: return fn(Q5_K{});
    case 5: return fn(Q6_K{});
    case 6: return fn(Q5_0{});
    case 7: return fn(Q5_1{});
    case 8: return fn(F16{});
    case 9: return fn(BF16{});
    default:
      TORCH_CHECK(false, "format must be 0-9 (Q4_1, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, F16, BF16), got ", format);
  }
}

template <typename Format, typename = void>
struct is_strip : std::false_type {};
template <typename Format>
struct is_strip<Format, std::void_t<decltype(Format::kStripBytes)>> : std::true_type {};

template <typename Format>
constexpr int64_t weights_per_block() {
  if constexpr (is_strip<Format>::value) return kBlock; else return Format::kWeights;
}

// Rows [n0, n1) of the matrix at weights [k0, k1) (whole blocks) as fp32: out[(n - n0) * ldo + k - k0],
// the values gguf_linear multiplies by. For the strip formats n0 must be a multiple of 8. The
// AVX2 path writes a strip's 8 columns 8 k at a time through an 8 x 8 transpose, where the
// portable loop stores every weight alone (the strips hold 8 columns at each k).
template <typename Format>
void decode_range_portable(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* out,
                           int64_t ldo) {
  if constexpr (is_strip<Format>::value) {
    const int64_t blocks = K / kBlock;
    float wb[kBlock][kStrip];
    for (int64_t s = n0 / kStrip; s * kStrip < n1; ++s)
      for (int64_t b = k0 / kBlock; b < k1 / kBlock; ++b) {
        Format::expand(w + (s * blocks + b) * Format::kStripBytes, wb);
        for (int64_t c = 0; c < std::min(kStrip, n1 - s * kStrip); ++c)
          for (int k = 0; k < kBlock; ++k) out[(s * kStrip + c - n0) * ldo + b * kBlock + k - k0] = wb[k][c];
      }
  } else {
    const int64_t nb = K / Format::kWeights;
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = k0 / Format::kWeights; b < k1 / Format::kWeights; ++b)
        Format::decode(w + (n * nb + b) * Format::kBytes, out + (n - n0) * ldo + b * Format::kWeights - k0);
  }
}

#ifdef KVSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// v[0..7] (rows) transposed in place: v[c][k] <- v[k][c].
inline void transpose8(__m256 v[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]), t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20), v[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
}

template <typename Format>
void decode_range_avx2(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* out,
                       int64_t ldo) {
  if constexpr (is_strip<Format>::value) {
    const int64_t blocks = K / kBlock;
    for (int64_t s = n0 / kStrip; s * kStrip < n1; ++s) {
      const int64_t cols = std::min(kStrip, n1 - s * kStrip);
      for (int64_t b = k0 / kBlock; b < k1 / kBlock; ++b) {
        float* o = out + (s * kStrip - n0) * ldo + b * kBlock - k0;
        __m256 v[8];
        Avx2<Format>::for_each_k(w + (s * blocks + b) * Format::kStripBytes, [&](int k, __m256 wk) {
          v[k % 8] = wk;
          if (k % 8 != 7) return;
          transpose8(v);
          for (int64_t c = 0; c < cols; ++c) _mm256_storeu_ps(o + c * ldo + k - 7, v[c]);
        });
      }
    }
  } else {
    const int64_t nb = K / Format::kWeights, b0 = k0 / Format::kWeights;
    for (int64_t n = n0; n < n1; ++n)
      decode_row_avx2<Format>(w + (n * nb + b0) * Format::kBytes, (k1 - k0) / Format::kWeights, out + (n - n0) * ldo);
  }
}

#pragma GCC pop_options
#endif

template <typename Format>
void decode_range(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* out,
                  int64_t ldo) {
#ifdef KVSERVE_X86
  if (has_avx2()) return decode_range_avx2<Format>(w, K, n0, n1, k0, k1, out, ldo);
#endif
  decode_range_portable<Format>(w, K, n0, n1, k0, k1, out, ldo);
}

// Shape of the packed tensor for an [N, K] matrix: strips [ceil(N / 8), K / 32 * strip bytes]
// or GGUF rows [N, K / weights per block * block bytes].
std::pair<int64_t, int64_t> packed_shape(int64_t N, int64_t K, int64_t format) {
  return with_format(format, [&](auto f) -> std::pair<int64_t, int64_t> {
    using Format = decltype(f);
    if constexpr (is_strip<Format>::value) return {(N + kStrip - 1) / kStrip, K / kBlock * Format::kStripBytes};
    else return {N, K / Format::kWeights * Format::kBytes};
  });
}

void check_packed(const at::Tensor& packed, int64_t N, int64_t K, int64_t format) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed weights must be a contiguous 2-D uint8 tensor from gguf_pack");
  const int64_t per_block = with_format(format, [&](auto f) { return weights_per_block<decltype(f)>(); });
  TORCH_CHECK(N >= 1 && K >= per_block && K % per_block == 0, "packed weights do not hold ", N, " x ", K,
              " weights of this format");
  const auto shape = packed_shape(N, K, format);
  TORCH_CHECK(packed.size(0) == shape.first && packed.size(1) == shape.second,
              "packed weights do not hold ", N, " x ", K, " weights of this format");
}

// GGUF rows [N, K / 32 * gguf_block_bytes] uint8 -> packed strips [ceil(N / 8), K / 32 * strip_block_bytes].
// Only the strip formats (Q4_1, Q8_0, Q5_0) are regrouped; the row formats run on the GGUF rows as they are.
at::Tensor gguf_pack(const at::Tensor& gguf, int64_t K, int64_t format) {
  return with_format(format, [&](auto f) -> at::Tensor {
    using Format = decltype(f);
    if constexpr (!is_strip<Format>::value) {
      TORCH_CHECK(false, "format ", format, " runs on GGUF rows as stored: nothing to pack");
    } else {
      TORCH_CHECK(gguf.dim() == 2 && gguf.scalar_type() == at::kByte && gguf.is_contiguous(),
                  "GGUF weights must be a contiguous 2-D uint8 tensor");
      TORCH_CHECK(K >= kBlock && K % kBlock == 0 && gguf.size(1) == K / kBlock * Format::kGgufBytes,
                  "GGUF rows do not hold K / 32 blocks of this format");
      const int64_t N = gguf.size(0), blocks = K / kBlock, strips = (N + kStrip - 1) / kStrip;
      at::Tensor packed = at::empty({strips, blocks * Format::kStripBytes}, gguf.options());
      const uint8_t* src = gguf.data_ptr<uint8_t>();
      uint8_t* dst = packed.data_ptr<uint8_t>();
      for (int64_t s = 0; s < strips; ++s)
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* cols[kStrip];
          for (int64_t c = 0; c < kStrip; ++c) {
            const int64_t n = s * kStrip + c;
            cols[c] = n < N ? src + (n * blocks + b) * Format::kGgufBytes : nullptr;
          }
          Format::pack(cols, dst + (s * blocks + b) * Format::kStripBytes);
        }
      return packed;
    }
  });
}

// Fill panel[0 : n1 - n0] (row stride K) with rows [n0, n1), in parallel over groups of 8 rows.
template <typename Format>
void decode_rows_parallel(const uint8_t* src, int64_t K, int64_t n0, int64_t n1, float* panel) {
  const int64_t groups = (n1 - n0 + kStrip - 1) / kStrip;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const int64_t a = n0 + g0 * kStrip, b = std::min(n1, n0 + g1 * kStrip);
    decode_range<Format>(src, K, a, b, 0, K, panel + (a - n0) * K, K);
  });
}

// packed -> [N, K] fp32: the values the kernel multiplies by.
at::Tensor gguf_unpack(const at::Tensor& packed, int64_t N, int64_t K, int64_t format) {
  check_packed(packed, N, K, format);
  at::Tensor out = at::empty({N, K}, packed.options().dtype(at::kFloat));
  with_format(format, [&](auto f) {
    decode_rows_parallel<decltype(f)>(packed.data_ptr<uint8_t>(), K, 0, N, out.data_ptr<float>());
    return 0;
  });
  return out;
}

// Rows ids[t] of the matrix as fp32 [T, K]: an embedding lookup straight from the blocks.
at::Tensor gguf_rows(const at::Tensor& packed, int64_t N, int64_t K, int64_t format, const at::Tensor& ids) {
  check_packed(packed, N, K, format);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-D int64 tensor");
  const auto idc = ids.contiguous();
  const int64_t T = idc.size(0);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < N, "row id ", id[t], " out of range [0, ", N, ")");
  at::Tensor out = at::empty({T, K}, packed.options().dtype(at::kFloat));
  with_format(format, [&](auto f) {
    using Format = decltype(f);
    const uint8_t* src = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> strip;
      for (int64_t t = t0; t < t1; ++t) {
        if constexpr (is_strip<Format>::value) {  // decode the row's strip of 8, keep its one row
          const int64_t n0 = id[t] / kStrip * kStrip, n1 = std::min(N, n0 + kStrip);
          strip.resize((n1 - n0) * K);
          decode_range<Format>(src, K, n0, n1, 0, K, strip.data(), K);
          std::copy(strip.begin() + (id[t] - n0) * K, strip.begin() + (id[t] - n0 + 1) * K, o + t * K);
        } else {
          decode_range<Format>(src, K, id[t], id[t] + 1, 0, K, o + t * K, K);
        }
      }
    });
    return 0;
  });
  return out;
}

// x [M, K] fp32, packed [N, K] matrix -> [M, N] fp32, streaming the blocks once.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, N, K, format);
  const auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_format(format, [&](auto f) {
    using Format = decltype(f);
    if constexpr (is_strip<Format>::value) {
      at::parallel_for(0, packed.size(0), 1, [&](int64_t s0, int64_t s1) {
        linear_strips<Format>(xp, M, K, wp, s0, s1, op, N, N);
      });
    } else {
      at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
#ifdef KVSERVE_X86
        if (has_avx2()) return linear_rows_avx2<Format>(xp, M, K, wp, n0, n1, op, N);
#endif
        linear_rows_portable<Format>(xp, M, K, wp, n0, n1, op, N);
      });
    }
    return 0;
  });
  return out;
}

// The same product for many rows (prefill) without a resident dense copy: the matrix is
// decoded tile by tile (tile_rows output features, a multiple of 8) into one fp32 panel that
// stays cache-sized, and each tile is one GEMM (MKL) against all of x.
at::Tensor gguf_linear_panels(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format,
                              int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(tile_rows >= kStrip && tile_rows % kStrip == 0, "tile_rows must be a positive multiple of 8");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, N, K, format);
  const auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const int64_t tile = std::min(tile_rows, (N + kStrip - 1) / kStrip * kStrip);
  at::Tensor panel = at::empty({tile, K}, x.options());
  with_format(format, [&](auto f) {
    using Format = decltype(f);
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
      const int64_t n1 = std::min(N, n0 + tile);
      decode_rows_parallel<Format>(packed.data_ptr<uint8_t>(), K, n0, n1, panel.data_ptr<float>());
      out.narrow(1, n0, n1 - n0).copy_(at::mm(xc, panel.narrow(0, 0, n1 - n0).t()));
    }
    return 0;
  });
  return out;
}

// Which gguf_linear path this CPU runs: "avx2" or "portable" (a plain loop, several times
// slower than fp32 MKL; kvserve's auto backend does not pick the block kernel for it).
std::string gguf_kernel_isa() { return has_avx2() ? "avx2" : "portable"; }

}  // namespace

void kvserve::gguf_linear_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t format,
                                int64_t n0, int64_t n1, float* out, int64_t ldo) {
  if (n1 <= n0 || M == 0) return;
  with_format(format, [&](auto f) {
    using Format = decltype(f);
    if constexpr (is_strip<Format>::value) {
      // linear_strips writes strip s at out + s * 8: shift out so feature n0 lands at out[0]
      linear_strips<Format>(x, M, K, w, n0 / kStrip, (n1 + kStrip - 1) / kStrip, out - n0, std::min(n1, N), ldo);
    } else {
#ifdef KVSERVE_X86
      if (has_avx2()) return linear_rows_avx2<Format>(x, M, K, w, n0, n1, out - n0, ldo);
#endif
      linear_rows_portable<Format>(x, M, K, w, n0, n1, out - n0, ldo);
    }
  });
}

void kvserve::gguf_check_packed(const at::Tensor& packed, int64_t N, int64_t K, int64_t format) {
  check_packed(packed, N, K, format);
}

void kvserve::gguf_decode_range(const uint8_t* w, int64_t K, int64_t format, int64_t n0, int64_t n1, int64_t k0,
                                int64_t k1, float* out, int64_t ldo) {
  with_format(format, [&](auto f) {
    decode_range<decltype(f)>(w, K, n0, n1, k0, k1, out, ldo);
    return 0;
  });
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_kernel_isa() -> str", &gguf_kernel_isa);
  m.def("gguf_pack(Tensor gguf, int in_features, int format) -> Tensor");
  m.def("gguf_unpack(Tensor packed, int out_features, int in_features, int format) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
  m.def("gguf_rows(Tensor packed, int out_features, int in_features, int format, Tensor ids) -> Tensor");
  m.def("gguf_linear_panels(Tensor x, Tensor packed, int out_features, int format, int tile_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_pack", &gguf_pack);
  m.impl("gguf_unpack", &gguf_unpack);
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_linear_panels", &gguf_linear_panels);
  m.impl("gguf_rows", &gguf_rows);
}
