// Small vector math that more than one kernel computes, in one place so that every caller gets
// the same numbers:
// - exp_nonpositive: paged_attention.h's softmax and silu_mul;
// - silu_mul (SiLU(gate) * up): the native decode layer (decode_layer.cpp) and the fused gate/up
//   matmul (quant_linear_q8.cpp's gguf_swiglu_q8);
// - hsum8 (x86): the horizontal sums of paged_attention.h, quant_linear.cpp and quant_linear_q8.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"  // KVSERVE_X86, <immintrin.h>

namespace kvserve {

// exp for x <= 0 (softmax inputs after max subtraction): Cody-Waite range reduction and a
// degree-6 polynomial, written so the compiler vectorizes it. Relative error ~2e-7.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// act[j] = SiLU(gate[j]) * up[j], vectorized: sigmoid from exp(-|g|) <= 1 (exp_nonpositive,
// ~2e-7 relative), where std::exp was a libm call per element (~4% of a 16-row decode step).
inline void silu_mul(const float* gate, const float* up, int64_t n, float* act) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float g = gate[j], e = exp_nonpositive(-std::fabs(g));
    act[j] = g * (g >= 0.f ? 1.f : e) / (1.f + e) * up[j];
  }
}

#ifdef KVSERVE_X86
// The sum of v's 8 lanes, always in the same order: (lanes 0-3 + 4-7), then pairs, then the two.
__attribute__((target("avx2"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace kvserve
