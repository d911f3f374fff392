// Unpacking of GGUF block codes shared by the fp32 (quant_linear.cpp) and the int8-activation
// (quant_linear_q8.cpp) block matmuls, so both read the same bits the same way.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace kvserve {

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

// The 32 four-bit codes of a Q4_0 block's 16 bytes qs, weight order (low nibbles, then high).
__attribute__((target("avx2"))) inline __m256i q4_codes(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}
#endif

}  // namespace kvserve
