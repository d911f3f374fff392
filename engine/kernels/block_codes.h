// Unpacking of GGUF block codes shared by the fp32 (quant_linear.cpp) and the int8-activation
// (quant_linear_q8.cpp) block matmuls, so both read the same bits the same way.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace kvserve {

// engine/quant.py's BlockFormat codes, as the kernels take them, and the bytes of a GGUF K-quant
// super-block of 256 weights (Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles;
// Q5_K: the same and 32 bytes of fifth bits; Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16
// int8 scales, d).
namespace blocks {
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kQ5_0 = 6, kQ5_1 = 7;
constexpr int64_t kQ4_KBytes = 144, kQ5_KBytes = 176, kQ6_KBytes = 210;
}  // namespace blocks

// A little-endian uint32 at p (Q5_0 / Q5_1 keep their 32 fifth bits so).
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(__x86_64__) && defined(__GNUC__)
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
#endif

}  // namespace kvserve
