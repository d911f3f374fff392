// GGUF blocks as the kernels read them: the BlockFormat codes and block sizes (namespace blocks),
// and the unpacking of block codes shared by the fp32 (quant_linear.cpp), the int8-activation
// (quant_linear_q8.cpp) and the AMX (quant_linear_amx.cpp) block matmuls, so all read the same bits
// the same way. Included by those three and by decode_layer.cpp (the format codes).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_features.h"  // KVSERVE_X86, <immintrin.h>

namespace kvserve {

// engine/loader/gguf/blocks.py's BlockFormat codes, as the kernels take them, and the bytes of a GGUF K-quant
// super-block of 256 weights (Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles;
// Q5_K: the same and 32 bytes of fifth bits; Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16
// int8 scales, d).
namespace blocks {
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kQ5_0 = 6, kQ5_1 = 7;
// Unquantized halves (F16, BF16 files): GGUF rows of K values, read 32 at a time as if in blocks.
constexpr int64_t kF16 = 8, kBF16 = 9, kNumFormats = 10;
constexpr int64_t kQ4_KBytes = 144, kQ5_KBytes = 176, kQ6_KBytes = 210;
// quant_linear.cpp's strips: 8 output columns, strip-blocks of 32 k (Q4_1 160 bytes, Q8_0 272, Q5_0 176)
constexpr int64_t kStripColumns = 8, kQ4_1StripBytes = 160, kQ8_0StripBytes = 272, kQ5_0StripBytes = 176;
// Whether `format`'s packed matrices are strips (gguf_pack regroups them), not GGUF rows.
constexpr bool is_strip_format(int64_t format) { return format == kQ4_1 || format == kQ8_0 || format == kQ5_0; }
// The bytes of one strip-block of a strip format (0 for the others).
constexpr int64_t strip_block_bytes(int64_t format) {
  return format == kQ4_1 ? kQ4_1StripBytes : format == kQ8_0 ? kQ8_0StripBytes : format == kQ5_0 ? kQ5_0StripBytes : 0;
}
}  // namespace blocks

// A little-endian uint32 at p (Q5_0 / Q5_1 keep their 32 fifth bits so).
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#ifdef KVSERVE_X86
// The 32 five-bit codes of a Q5_0 / Q5_1 block, weight order: the nibbles of qs (low nibbles
// weights 0-15, high 16-31) | bit j of qh << 4.
__attribute__((target("avx2"))) inline __m256i q5_codes(const uint8_t* qh_bytes, const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(15);
  const __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
  // byte j of `spread` = byte j / 8 of qh; then test bit j % 8
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(u32_at(qh_bytes))),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(lo, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

// Q4_K's (and Q5_K's) 8 6-bit sub-block scales and 8 mins as gguf's dequantize (get_scale_min_k4)
// reads them from the 12 bytes s0 s1 s2 at b + 4, one byte each: bytes 0-7 the scales, 8-15 the mins
// (dwords [s0 & k6, (s2 & k4) | ((s0 >> 6) & k2) << 4, s1 & k6, ((s2 >> 4) & k4) | ((s1 >> 6) & k2) << 4];
// in registers: scalar stores and a vector load would stall).
__attribute__((target("avx2"))) inline __m128i q4_k_scales(const uint8_t* b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // s0 s1 s2 and 4 code bytes
  const __m128i p = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 6),
                                    _mm_setr_epi32(0, 0x03030303, 0, 0x03030303));
  return _mm_or_si128(_mm_and_si128(p, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                      _mm_slli_epi32(top, 4));
}

// The 6-bit codes of half h of a Q6_K super-block at b (weights 128 h .. 128 h + 127), as gguf's
// dequantize orders them: q[c] = the codes of weights 128 h + 32 c .. + 31 (unsigned, 0..63).
__attribute__((target("avx2"))) inline void q6_k_codes(const uint8_t* b, int h, __m256i* q) {
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  const __m256i l[2] = {l0, l1};
  for (int c = 0; c < 4; ++c) {  // low nibbles of l0, l1, then high; the high pair at bits 2c of qh
    const __m256i lo4 = c < 2 ? l[c] : _mm256_srli_epi16(l[c - 2], 4);
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), m2);
    q[c] = _mm256_or_si256(_mm256_and_si256(lo4, m4), _mm256_slli_epi16(high, 4));
  }
}

// The 32 four-bit codes of a Q4_0 block's 16 bytes qs, weight order (low nibbles, then high).
__attribute__((target("avx2"))) inline __m256i q4_codes(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

// ---- Strips of nibbles (Q4_1, Q5_0: quant_linear.cpp's strips of 8 output columns, strip-blocks
// of 32 k). The nibbles go in 4 chunks o of 32 bytes; byte 4c + e of chunk o holds column c at
// k = 8o + e (low nibble) and k = 8o + 4 + e (high nibble). So one mask gives k-quad 2o, one dword
// a column (column c's 4 codes at k = 8o .. 8o + 3), and one shift and mask k-quad 2o + 1: the
// operand of vpdpbusd against a broadcast activation quad (quant_linear_q8.cpp) and the rows of an
// AMX B tile (quant_linear_amx.cpp), with no byte shuffles. (The layout before issue 39's last
// stops interleaved the columns by k pairs, and re-laying it took ~44 operations a pair-block,
// most on the shuffle port: a layer's four one-row matmuls ran 1.2-1.4x slower.) Q5_0's fifth bits: bit 2o of byte j of the
// 32 at `fifth` is that of chunk o's byte j's low nibble, bit 2o + 1 of its high nibble.

// Chunk o of one strip-block's nibbles at `codes` (and Q5_0's fifth bits at `fifth`) as its two
// k-quads: lo = k-quad 2o, hi = k-quad 2o + 1 (codes 0..15, Q5_0 0..31).
template <bool kFifth>
__attribute__((target("avx2"))) inline void nibble_quads(const uint8_t* codes, const uint8_t* fifth, int o,
                                                         __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * o));
  lo = _mm256_and_si256(q, mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
  if (kFifth) {  // bits 2o, 2o + 1 of each byte to bit 4 of the low and the high nibble's code
    const __m256i t = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(fifth)), _mm_cvtsi32_si128(2 * o));
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi8(1)), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi8(2)), 3));
  }
}

// ---- Two adjacent full strips (strip-blocks at a and b) as 8 k-quads of 16 columns: dword c of
// w[j] = column c's 4 codes at k = 4j .. 4j + 3, strip a's columns 0-7, b's 8-15.
#define KVSERVE_ZMM_TARGET __attribute__((target("avx2,avx512f,avx512vl,avx512bw")))

KVSERVE_ZMM_TARGET inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// The nibble codes at byte `codes` of each strip-block (Q4_1: 32, Q5_0: 16), kFifth (Q5_0) with
// the fifth bits at byte `fifth` added as 16.
template <bool kFifth>
KVSERVE_ZMM_TARGET inline void relay_nibbles_pair(const uint8_t* a, const uint8_t* b, int64_t codes, int64_t fifth,
                                                  __m512i* w) {
  const __m512i mask = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
  const __m512i f = kFifth ? load_pair(a + fifth, b + fifth) : _mm512_setzero_si512();
  for (int o = 0; o < 4; ++o) {
    const __m512i q = load_pair(a + codes + 32 * o, b + codes + 32 * o);
    __m512i c0 = _mm512_and_si512(q, mask), c1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), mask);
    if (kFifth) {  // + 16 where bit 2o (low nibble) or 2o + 1 (high) of the byte is set
      c0 = _mm512_mask_add_epi8(c0, _mm512_test_epi8_mask(f, _mm512_set1_epi8(static_cast<char>(1 << (2 * o)))), c0, sixteen);
      c1 = _mm512_mask_add_epi8(c1, _mm512_test_epi8_mask(f, _mm512_set1_epi8(static_cast<char>(2 << (2 * o)))), c1, sixteen);
    }
    w[2 * o] = c0, w[2 * o + 1] = c1;
  }
}

// Q4_1 (unsigned codes 0..15 from byte 32 of a strip-block).
KVSERVE_ZMM_TARGET inline void relay_q4_1_pair(const uint8_t* a, const uint8_t* b, __m512i* w) {
  relay_nibbles_pair<false>(a, b, 32, 0, w);
}

// Q5_0 (codes 0..31: the nibbles from byte 16, the fifth bits from byte 144).
KVSERVE_ZMM_TARGET inline void relay_q5_0_pair(const uint8_t* a, const uint8_t* b, __m512i* w) {
  relay_nibbles_pair<true>(a, b, 16, 144, w);
}

// Q8_0 (signed codes): bytes 16 + 32j .. + 31 of a strip-block are k-quad j of its 8 columns,
// one dword a column (quant_linear.cpp), so the pair's quad j is one load of each.
KVSERVE_ZMM_TARGET inline void relay_q8_0_pair(const uint8_t* a, const uint8_t* b, __m512i* w) {
  for (int j = 0; j < 8; ++j) w[j] = load_pair(a + 16 + 32 * j, b + 16 + 32 * j);
}

// 16 fp16 scales: 8 at a, 8 at b.
KVSERVE_ZMM_TARGET inline __m512 halves16(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
#undef KVSERVE_ZMM_TARGET
#endif

}  // namespace kvserve
