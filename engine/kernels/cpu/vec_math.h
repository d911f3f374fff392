// Small vector math that more than one kernel computes, in one place so that every caller gets
// the same numbers:
// - exp_nonpositive: paged_attention.h's softmax and silu_mul;
// - silu_mul (SiLU(gate) * up): the native decode layer (decode_layer.cpp) and the fused gate/up
//   matmul (quant_linear_q8.cpp's gguf_swiglu_q8);
// - rms_norm_row and rope_row: the native decode layer (decode_layer.cpp) and a prefill chunk's
//   rows (prefill_rows.cpp), so decode rows and prefill rows are normed and rotated alike;
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

// y[0:K] = x / sqrt(mean(x^2) + eps) * w, as F.rms_norm in fp32 (its sum in another order). y may be x.
inline void rms_norm_row(const float* x, const float* w, int64_t K, float eps, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t k = 0; k < K; ++k) ss += x[k] * x[k];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; ++k) y[k] = x[k] * inv * w[k];
}

// v[0:D] <- v * cos + [v2, v1] * sin_signed (engine/model/rope.py apply_rope_signed); tmp holds D.
inline void rope_row(float* v, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) tmp[i] = v[i] * cos[i] + v[i + half] * sin[i];
  for (int64_t i = half; i < D; ++i) tmp[i] = v[i] * cos[i] + v[i - half] * sin[i];
  std::copy(tmp, tmp + D, v);
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
