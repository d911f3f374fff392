// Paged decode attention over int4 KV pools (KIVI, engine/kv/int4.py), read in place: one query
// token per sequence, fp32 queries and outputs; the per-(sequence, KV head) routine and how it
// reads the format are kv_int4.h's (shared with decode_layer.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_int4.h"

namespace {

using kvserve::attend_int4;
using kvserve::Int4Pools;

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
