// Paged decode attention over int4 KV pools (KIVI, engine/kv/int4.py), read in place: one query
// token per sequence, fp32 queries and outputs.
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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

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

struct Int4Pools {
  const uint8_t* kc;
  const c10::Half* ks;  // [N, KVH, 2, D]
  const uint8_t* vc;
  const c10::Half* vs;  // [N, bs, KVH, 2]
  const float* kr;      // [R, bs, KVH, D]
  const float* vr;
  const int32_t* slot_of;  // [N]
  int64_t bs, KVH, D;
};

// Query heads [h*G, (h+1)*G) of one sequence (q [H, D]) against its first len tokens of KV head h.
void attend_int4(const float* q, const Int4Pools& p, const int64_t* table, int64_t len, int64_t h, int64_t G,
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

// q [B, H, D] fp32; k_codes, v_codes uint8 [N, bs, KVH, D/2]; k_scale fp16 [N, KVH, 2, D];
// v_scale fp16 [N, bs, KVH, 2]; k_res, v_res fp32 [R, bs, KVH, D]; slot_of int32 [N];
// block_tables [B, W]; context_lens [B] >= 1. -> [B, H, D] fp32.
at::Tensor paged_decode_attention_int4(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                       const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& k_res,
                                       const at::Tensor& v_res, const at::Tensor& slot_of,
                                       const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be fp32 [B, H, D]");
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte && k_codes.dim() == 4 &&
                  k_codes.sizes() == v_codes.sizes() && k_codes.is_contiguous() && v_codes.is_contiguous(),
              "the codes must be two contiguous uint8 [N, bs, KVH, D/2] pools");
  const int64_t N = k_codes.size(0), bs = k_codes.size(1), KVH = k_codes.size(2), D = 2 * k_codes.size(3);
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK(q.size(2) == D && H % KVH == 0, "head_dim or head counts do not match");
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf && k_scale.is_contiguous() &&
                  v_scale.is_contiguous(), "the scales must be contiguous fp16");
  TORCH_CHECK(k_scale.sizes() == std::vector<int64_t>({N, KVH, 2, D}), "k_scale must be [N, KVH, 2, D]");
  TORCH_CHECK(v_scale.sizes() == std::vector<int64_t>({N, bs, KVH, 2}), "v_scale must be [N, bs, KVH, 2]");
  TORCH_CHECK(k_res.scalar_type() == at::kFloat && v_res.scalar_type() == at::kFloat && k_res.is_contiguous() &&
                  v_res.is_contiguous() && k_res.sizes() == v_res.sizes() && k_res.dim() == 4 &&
                  k_res.size(1) == bs && k_res.size(2) == KVH && k_res.size(3) == D,
              "the residuals must be contiguous fp32 [R, bs, KVH, D]");
  TORCH_CHECK(slot_of.scalar_type() == at::kInt && slot_of.numel() == N && slot_of.is_contiguous(),
              "slot_of must be int32 [N]");
  const auto tables = block_tables.to(at::kLong).contiguous();
  const auto lens = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.numel() == B, "one table row and length per query");
  const int64_t W = tables.size(1), R = k_res.size(0);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int32_t* so = slot_of.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, "a context is empty or longer than its block table");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j) {
      TORCH_CHECK(tp[b * W + j] >= 0 && tp[b * W + j] < N, "block id out of range");
      TORCH_CHECK(so[tp[b * W + j]] < R, "residual slot out of range");
    }
  }
  const auto qc = q.contiguous();
  auto out = at::empty({B, H, D}, qc.options());
  const Int4Pools p{k_codes.data_ptr<uint8_t>(), k_scale.data_ptr<c10::Half>(), v_codes.data_ptr<uint8_t>(),
                    v_scale.data_ptr<c10::Half>(), k_res.data_ptr<float>(), v_res.data_ptr<float>(), so, bs, KVH, D};
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / KVH, jobs = B * KVH;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, jobs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, work;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KVH, h = job % KVH;
      attend_int4(qp + b * H * D, p, tp + b * W, lp[b], h, G, fscale, op + b * H * D, scores, work);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_decode_attention_int4(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, "
        "Tensor k_res, Tensor v_res, Tensor slot_of, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_attention_int4", &paged_decode_attention_int4); }
