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
// all G query heads that share it, so each code row is widened once for G dot products. The loops
// are plain and `omp simd`, compiled for the machine (-march=native: AVX-512 where it has it), as
// the int8 kernel's are.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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

inline void widen_codes(const uint8_t* src, int64_t D, float* dst) {
#pragma omp simd
  for (int64_t i = 0; i < D / 2; ++i) {
    dst[2 * i] = static_cast<float>(src[i] & 15);
    dst[2 * i + 1] = static_cast<float>(src[i] >> 4);
  }
}

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
// Query heads [h*G, (h+1)*G) of one sequence (q [H, D]) against its first len tokens of KV head h;
// out [H, D] (the sequence's rows). scores and work are the caller's scratch (resized here).
inline void attend_int4(const float* q, const Int4Pools& p, const int64_t* table, int64_t len, int64_t h, int64_t G,
                        float scale, float* out, std::vector<float>& scores, std::vector<float>& work) {
  const int64_t D = p.D, bs = p.bs, KVH = p.KVH;
  const int64_t nblocks = (len + bs - 1) / bs;
  scores.resize(G * len);
  work.resize(G * D + 2 * D + G * D + G);
  float* qs = work.data();      // [G, D]: q * step of the block
  float* row = qs + G * D;      // [D] widened codes
  float* tmp = row + D;         // [D] a block's step or minimum
  float* acc = tmp + D;         // [G, D]
  float* bias = acc + G * D;    // [G]
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
    const c10::Half* sc = p.ks + (blk * KVH + h) * 2 * D;
    for (int64_t c = 0; c < D; ++c) tmp[c] = static_cast<float>(sc[D + c]);  // minimum
    for (int64_t g = 0; g < G; ++g) qmin[g] = dot(qh + g * D, tmp, D);
    for (int64_t c = 0; c < D; ++c) tmp[c] = static_cast<float>(sc[c]);  // step
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qh + g * D;
      float* o = qs + g * D;
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) o[c] = qg[c] * tmp[c];
    }
    for (int64_t i = 0; i < n; ++i, ++t) {
      widen_codes(p.kc + ((blk * bs + i) * KVH + h) * (D / 2), D, row);
      for (int64_t g = 0; g < G; ++g) scores[g * len + t] = (dot(qs + g * D, row, D) + qmin[g]) * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // max-subtracted softmax, in fp32
    float* s = scores.data() + g * len;
    const float m = *std::max_element(s, s + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - m));
    const float inv = 1.f / total;
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
  std::fill(acc, acc + G * D + G, 0.f);  // acc and bias
  for (int64_t j = 0, t = 0; j < nblocks; ++j) {
    const int64_t blk = table[j], n = std::min(bs, len - j * bs);
    const int32_t slot = p.slot_of[blk];
    for (int64_t i = 0; i < n; ++i, ++t) {
      const float* v;
      float step = 1.f, minimum = 0.f;
      if (slot >= 0) {
        v = p.vr + ((slot * bs + i) * KVH + h) * D;
      } else {
        widen_codes(p.vc + ((blk * bs + i) * KVH + h) * (D / 2), D, row);
        const c10::Half* sc = p.vs + ((blk * bs + i) * KVH + h) * 2;
        step = static_cast<float>(sc[0]);
        minimum = static_cast<float>(sc[1]);
        v = row;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float pt = scores[g * len + t];
        bias[g] += pt * minimum;
        const float w = pt * step;
        float* a = acc + g * D;
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) a[c] += w * v[c];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < D; ++c) out[(h * G + g) * D + c] = acc[g * D + c] + bias[g];
}

}  // namespace kvserve
