// The per-sequence decode attention of paged_attention.cpp, shared with decode_layer.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve {

struct Layout {
  const int64_t* table;  // this sequence's block ids
  int64_t len;           // cached tokens to attend to
  int64_t block_size;
  int64_t token_stride;  // floats between consecutive tokens of a block (kv_heads * head_dim)
  int64_t block_stride;  // floats between blocks
};

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

// Asks for one token row of the next block while the current one is processed: blocks sit
// anywhere in the pool, so the hardware prefetcher cannot guess where the next one starts.
inline void prefetch_row(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i);
}

// Calls fn(row, t) for the sequence's cached tokens t = 0 .. len-1 in order, row pointing at
// token t's entry in pool (keys or values of all kv heads), block by block as the table says.
template <typename Fn>
inline void for_each_row(const float* pool, const Layout& lay, Fn&& fn) {
  const int64_t num_blocks = (lay.len + lay.block_size - 1) / lay.block_size;
  for (int64_t j = 0, t = 0; j < num_blocks; ++j) {
    const float* block = pool + lay.table[j] * lay.block_stride;
    const float* next = j + 1 < num_blocks ? pool + lay.table[j + 1] * lay.block_stride : nullptr;
    const int64_t n = std::min(lay.block_size, lay.len - j * lay.block_size);
    for (int64_t i = 0; i < n; ++i, ++t) {
      if (next) prefetch_row(next + i * lay.token_stride, lay.token_stride);
      fn(block + i * lay.token_stride, t);
    }
  }
}

// Heads [h0, h1) of one sequence against its cached tokens. q [H, D] (this sequence's
// queries); k/v the pools; scores is scratch [h1 - h0, len]; acc scratch [h1 - h0, D];
// out [H, D] (this sequence's output rows). Every cached token's row of those heads is read
// once, in block order.
inline void attend(const float* q, const float* k, const float* v, const Layout& lay, int64_t h0, int64_t h1,
            int64_t G, int64_t D, float scale, float* scores, float* acc, float* out) {
  const int64_t L = lay.len, nh = h1 - h0;
  for_each_row(k, lay, [&](const float* kt, int64_t t) {
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = q + h * D;
      const float* kh = kt + (h / G) * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < D; ++i) s += qh[i] * kh[i];
      scores[(h - h0) * L + t] = s * scale;
    }
  });
  for (int64_t h = 0; h < nh; ++h) {
    float* s = scores + h * L;
    float m = s[0];
    for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      s[t] = exp_nonpositive(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  std::fill(acc, acc + nh * D, 0.f);
  for_each_row(v, lay, [&](const float* vt, int64_t t) {
    for (int64_t h = h0; h < h1; ++h) {
      const float p = scores[(h - h0) * L + t];
      const float* vh = vt + (h / G) * D;
      float* a = acc + (h - h0) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] += p * vh[i];
    }
  });
  std::copy(acc, acc + nh * D, out + h0 * D);
}

}  // namespace kvserve
