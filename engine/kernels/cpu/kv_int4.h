// int4 KV pools (KIVI, engine/kv/int4.py) as the kernels read and write them, shared by
// paged_attention_int4.cpp (the attention op) and decode_layer.cpp (DecodeStack): the pools'
// pointers, the quantization of a completed block, and the per-(sequence, KV head) attention.
//
// A block is either quantized or open. A quantized block holds 4-bit codes, two per byte (channel
// 2i in the low nibble), keys with a (step, minimum) per channel for the block and head, values
// with one per token and head (fp16); an open block (slot_of[block] >= 0) is read from the
// residual, fp32 rows in the model's dtype. No dequantized row is stored: for keys
// q . k = sum_c (q_c step_c) code_c + q . min, so each quantized block costs one elementwise
// product q * step and one dot product q . min per query head, then one dot product per token
// over the widened codes; for values sum_t p_t (code_t step_t + min_t) = sum_t (p_t step_t) code_t
// + sum_t p_t min_t, the second term one scalar per head. A job is one (sequence, KV head) with
// all G query heads that share it, so each code row is widened once for G dot products. Codes
// are widened as two contiguous halves (even channels from the low nibbles, odd ones from the
// high), with q * step and the value sums kept in that order. With AVX2 (and head_dim a multiple
// of 16, at most 128) a quantized block's key dots take 4 tokens at a time and its value sums
// stay in registers, as paged_attention.h's fp16 kernel does (2.2x its time at 16 sequences of
// 96 tokens, SmolLM2's heads, one thread; the plain loops took 7x); else plain `omp simd` loops.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_features.h"     // KVSERVE_X86, cpu_has_avx2
#include "paged_attention.h"  // softmax_rows

namespace kvserve {

// One layer's int4 K and V pools and the pool's residual (engine/kv/int4.py's layout).
struct Int4Pools {
  uint8_t* kc;             // [N, bs, KVH, D/2]
  c10::Half* ks;           // [N, KVH, 2, D]: (step [D], minimum [D]) per block and head
  uint8_t* vc;             // [N, bs, KVH, D/2]
  c10::Half* vs;           // [N, bs, KVH, 2]: (step, minimum) per token and head
  float* kr;               // [R, bs, KVH, D]
  float* vr;
  const int32_t* slot_of;  // [N]: residual slot of an open block, -1 for a quantized one
  int64_t bs, KVH, D;
};

inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < D; ++i) s += a[i] * b[i];
  return s;
}

// ---- the write: int4.py's quantize_keys / quantize_values, bit for bit ----------------------
// (step, minimum) = ((max - min) / 15 clamped to >= 1e-6, min), both rounded to fp16; a value's
// code is round-half-even((x - minimum) / step) in fp32 over the fp16 scales, clamped to 0..15.
constexpr int kLevels = 15;

inline void int4_range(float lo, float hi, c10::Half* step, c10::Half* minimum) {
  *step = c10::Half(std::max((hi - lo) / static_cast<float>(kLevels), static_cast<float>(1e-6)));
  *minimum = c10::Half(lo);
}

inline uint8_t int4_code(float x, float step, float minimum) {
  const float c = std::nearbyint((x - minimum) / step);
  return static_cast<uint8_t>(std::min(std::max(c, 0.f), static_cast<float>(kLevels)));
}

// Keys of block `blk`, KV head g, from its bs token rows rows[i] (D fp32 each): a range per channel.
inline void quantize_key_block(const Int4Pools& p, int64_t blk, int64_t g, const float* const* rows) {
  const int64_t D = p.D, bs = p.bs, KVH = p.KVH;
  c10::Half* sc = p.ks + (blk * p.KVH + g) * 2 * D;
  for (int64_t c = 0; c < D; c += 2) {
    float step[2], minimum[2];
    for (int64_t j = 0; j < 2; ++j) {
      float lo = rows[0][c + j], hi = lo;
      for (int64_t i = 1; i < bs; ++i) lo = std::min(lo, rows[i][c + j]), hi = std::max(hi, rows[i][c + j]);
      int4_range(lo, hi, sc + c + j, sc + D + c + j);
      step[j] = static_cast<float>(sc[c + j]), minimum[j] = static_cast<float>(sc[D + c + j]);
    }
    for (int64_t i = 0; i < bs; ++i)
      p.kc[((blk * bs + i) * KVH + g) * (D / 2) + c / 2] =
          int4_code(rows[i][c], step[0], minimum[0]) | (int4_code(rows[i][c + 1], step[1], minimum[1]) << 4);
  }
}

// Value row of token i of block `blk`, KV head g, from v (D fp32): one range over the row.
inline void quantize_value_row(const Int4Pools& p, int64_t blk, int64_t i, int64_t g, const float* v) {
  const int64_t D = p.D;
  float lo = v[0], hi = v[0];
  for (int64_t c = 1; c < D; ++c) lo = std::min(lo, v[c]), hi = std::max(hi, v[c]);
  const int64_t at = (blk * p.bs + i) * p.KVH + g;
  c10::Half* sc = p.vs + at * 2;
  int4_range(lo, hi, sc, sc + 1);
  const float step = static_cast<float>(sc[0]), minimum = static_cast<float>(sc[1]);
  uint8_t* out = p.vc + at * (D / 2);
  for (int64_t c = 0; c < D; c += 2) out[c / 2] = int4_code(v[c], step, minimum) | (int4_code(v[c + 1], step, minimum) << 4);
}

// ---- the read ---------------------------------------------------------------------------------
// A code row's low nibbles (even channels) into lo[D/2] and high ones (odd channels) into hi[D/2]:
// contiguous stores, which vectorize, where the channel order's interleaved ones did not (the
// kernel then took ~3x the time of the fp16 pool's). The block's per-channel query products and
// the value accumulators are kept in the same even/odd order.
inline void split_codes(const uint8_t* src, int64_t half, float* lo, float* hi) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    lo[i] = static_cast<float>(src[i] & 15);
    hi[i] = static_cast<float>(src[i] >> 4);
  }
}

#ifdef KVSERVE_X86
__attribute__((target("avx2,f16c"))) inline int64_t halves_f16c(const c10::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return i;
}
#endif

// n fp16 scales as fp32 (F16C eight at a time where the CPU has it: c10::Half's scalar conversion
// per scale and query head had been most of the kernel's time).
inline void halves_to_floats(const c10::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef KVSERVE_X86
  if (cpu_has_avx2()) i = halves_f16c(src, n, dst);
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#ifdef KVSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// 8 codes of a row (bytes c .. c + 8) as their low (even channels) and high (odd) nibbles.
inline void nibbles8(const uint8_t* src, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

// scores[g * ld + i] = (qs_g . codes of token i + qmin[g]) * scale for the n tokens of a quantized
// block (code rows `stride` bytes apart) and NG <= 4 heads (qs_g: the block's q * step, even
// channels then odd ones), 4 tokens at a time, the 4 dot products of a head reduced together.
template <int NG>
inline void int4_key_dots(const float* qs, int64_t D, const uint8_t* codes, int64_t stride, int64_t n,
                          const float* qmin, float scale, float* scores, int64_t ld) {
  const int64_t half = D / 2;
  const __m128 sc = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m256 a[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int k = 0; k < 4; ++k) a[g][k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < half; c += 8) {
      __m256 lo[4], hi[4];
      for (int k = 0; k < 4; ++k) nibbles8(codes + (i + k) * stride + c, lo[k], hi[k]);
      for (int g = 0; g < NG; ++g) {
        const __m256 qe = _mm256_loadu_ps(qs + g * D + c), qo = _mm256_loadu_ps(qs + g * D + half + c);
        for (int k = 0; k < 4; ++k) a[g][k] = _mm256_fmadd_ps(qo, hi[k], _mm256_fmadd_ps(qe, lo[k], a[g][k]));
      }
    }
    for (int g = 0; g < NG; ++g) {
      const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
      const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1));
      _mm_storeu_ps(scores + g * ld + i, _mm_mul_ps(_mm_add_ps(dots, _mm_set1_ps(qmin[g])), sc));
    }
  }
  for (; i < n; ++i)
    for (int g = 0; g < NG; ++g) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t c = 0; c < half; c += 8) {
        __m256 lo, hi;
        nibbles8(codes + i * stride + c, lo, hi);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + half + c), hi,
                            _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + c), lo, a));
      }
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      scores[g * ld + i] = (_mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) + qmin[g]) * scale;
    }
}

// acc[0 .. D) (even channels, then odd) += sum_i w[i] codes of token i, for the n tokens of a
// quantized block, D / 2 <= 64 (the accumulators stay in registers).
inline void int4_value_sum(const float* w, const uint8_t* codes, int64_t stride, int64_t n, int64_t D, float* acc) {
  const int64_t half = D / 2, nv = half / 8;
  __m256 lo_acc[8], hi_acc[8];
  for (int64_t c = 0; c < nv; ++c) lo_acc[c] = _mm256_loadu_ps(acc + 8 * c), hi_acc[c] = _mm256_loadu_ps(acc + half + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 wi = _mm256_set1_ps(w[i]);
    for (int64_t c = 0; c < nv; ++c) {
      __m256 lo, hi;
      nibbles8(codes + i * stride + 8 * c, lo, hi);
      lo_acc[c] = _mm256_fmadd_ps(wi, lo, lo_acc[c]);
      hi_acc[c] = _mm256_fmadd_ps(wi, hi, hi_acc[c]);
    }
  }
  for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(acc + 8 * c, lo_acc[c]), _mm256_storeu_ps(acc + half + 8 * c, hi_acc[c]);
}

#pragma GCC pop_options
#endif

// Query heads [h*G, (h+1)*G) of one sequence (q [H, D]) against its first len tokens of KV head h;
// out [H, D] (the sequence's rows). scores and work are the caller's scratch (resized here).
inline void attend_int4(const float* q, const Int4Pools& p, const int64_t* table, int64_t len, int64_t h, int64_t G,
                        float scale, float* out, std::vector<float>& scores, std::vector<float>& work) {
  const int64_t D = p.D, half = D / 2, bs = p.bs, KVH = p.KVH;
  const int64_t nblocks = (len + bs - 1) / bs;
#ifdef KVSERVE_X86
  const bool avx2 = half % 8 == 0 && half <= 64 && cpu_has_avx2();
#endif
  scores.resize(G * len);
  work.resize(3 * G * D + 4 * D + G + bs);
  float* qs = work.data();      // [G, D]: q * step of the block, even channels then odd ones
  float* lo = qs + G * D;       // [D/2] a code row's even channels, then
  float* hi = lo + half;        // [D/2] its odd ones
  float* acc = hi + half;       // [G, D]: the residual rows' weighted sum, channel order
  float* acc_c = acc + G * D;   // [G, D]: the code rows' (p * step weighted), even then odd channels
  float* bias = acc_c + G * D;  // [G]
  float* w = bias + G;          // [bs]: a block's p * step, for one head
  float* sm = w + bs;           // [2D]: a block's key steps and minima; [2 bs] its value ones
  const float* qh = q + h * G * D;
  float qm[64];
  std::vector<float> qm_big;
  float* qmin = qm;
  if (G > 64) {
    qm_big.resize(G);
    qmin = qm_big.data();
  }
  for (int64_t j = 0, t = 0; j < nblocks; ++j) {
    const int64_t blk = table[j], n = std::min(bs, len - j * bs);
    const int32_t slot = p.slot_of[blk];
    if (slot >= 0) {
      for (int64_t i = 0; i < n; ++i, ++t) {
        const float* kr = p.kr + ((slot * bs + i) * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot(qh + g * D, kr, D) * scale;
      }
      continue;
    }
    halves_to_floats(p.ks + (blk * KVH + h) * 2 * D, 2 * D, sm);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qh + g * D;
      float* o = qs + g * D;
      for (int64_t c = 0; c < half; ++c) {
        o[c] = qg[2 * c] * sm[2 * c];
        o[half + c] = qg[2 * c + 1] * sm[2 * c + 1];
      }
      qmin[g] = dot(qg, sm + D, D);  // q . minimum
    }
    const uint8_t* codes = p.kc + ((blk * bs) * KVH + h) * half;
#ifdef KVSERVE_X86
    if (avx2) {
      for (int64_t g = 0; g < G; g += 4) {  // up to 4 heads share each widened code row
        const float *qg = qs + g * D, *mg = qmin + g;
        float* sg = scores.data() + g * len + t;
        switch (std::min<int64_t>(4, G - g)) {
          case 1: int4_key_dots<1>(qg, D, codes, KVH * half, n, mg, scale, sg, len); break;
          case 2: int4_key_dots<2>(qg, D, codes, KVH * half, n, mg, scale, sg, len); break;
          case 3: int4_key_dots<3>(qg, D, codes, KVH * half, n, mg, scale, sg, len); break;
          default: int4_key_dots<4>(qg, D, codes, KVH * half, n, mg, scale, sg, len); break;
        }
      }
      t += n;
      continue;
    }
#endif
    for (int64_t i = 0; i < n; ++i, ++t) {
      split_codes(codes + i * KVH * half, half, lo, hi);
      for (int64_t g = 0; g < G; ++g)
        scores[g * len + t] = (dot(qs + g * D, lo, half) + dot(qs + g * D + half, hi, half) + qmin[g]) * scale;
    }
  }
  softmax_rows(scores.data(), G, len);
  std::fill(acc, acc + 2 * G * D + G, 0.f);  // acc, acc_c and bias
  for (int64_t j = 0, t = 0; j < nblocks; ++j) {
    const int64_t blk = table[j], n = std::min(bs, len - j * bs);
    const int32_t slot = p.slot_of[blk];
#ifdef KVSERVE_X86
    if (avx2 && slot < 0) {
      const c10::Half* sc = p.vs + (blk * bs * KVH + h) * 2;
      const uint8_t* codes = p.vc + ((blk * bs) * KVH + h) * half;
      for (int64_t i = 0; i < n; ++i)
        sm[2 * i] = static_cast<float>(sc[i * KVH * 2]), sm[2 * i + 1] = static_cast<float>(sc[i * KVH * 2 + 1]);
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = scores.data() + g * len + t;
        for (int64_t i = 0; i < n; ++i) {
          bias[g] += pg[i] * sm[2 * i + 1];
          w[i] = pg[i] * sm[2 * i];
        }
        int4_value_sum(w, codes, KVH * half, n, D, acc_c + g * D);
      }
      t += n;
      continue;
    }
#endif
    for (int64_t i = 0; i < n; ++i, ++t) {
      if (slot >= 0) {
        const float* v = p.vr + ((slot * bs + i) * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float pt = scores[g * len + t];
          float* a = acc + g * D;
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) a[c] += pt * v[c];
        }
        continue;
      }
      split_codes(p.vc + ((blk * bs + i) * KVH + h) * half, half, lo, hi);
      const c10::Half* sc = p.vs + ((blk * bs + i) * KVH + h) * 2;
      const float step = static_cast<float>(sc[0]), minimum = static_cast<float>(sc[1]);
      for (int64_t g = 0; g < G; ++g) {
        const float pt = scores[g * len + t];
        bias[g] += pt * minimum;
        const float w = pt * step;
        float* a = acc_c + g * D;
#pragma omp simd
        for (int64_t c = 0; c < half; ++c) {
          a[c] += w * lo[c];
          a[half + c] += w * hi[c];
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float *a = acc + g * D, *e = acc_c + g * D;
    float* o = out + (h * G + g) * D;
    for (int64_t c = 0; c < half; ++c) {
      o[2 * c] = a[2 * c] + e[c] + bias[g];
      o[2 * c + 1] = a[2 * c + 1] + e[half + c] + bias[g];
    }
  }
}

}  // namespace kvserve
