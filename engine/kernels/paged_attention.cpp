// Paged decode attention on the CPU: one query token per sequence, keys and values read in
// place from the block pool, without the gather copy the torch backend makes. fp32.
//
// Threads split the batch by sequence; a job reads each cached token's row (all kv heads, one
// contiguous run) once for the scores and once for the values, walking the blocks in table
// order so the hardware prefetcher streams each block. Softmax is max-subtracted, in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using kvserve::Layout;
using kvserve::attend;

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, W];
// context_lens [B] >= 1. Row b attends to its first context_lens[b] cached tokens. -> [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q must be 3-D and the caches 4-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "paged_decode_attention is fp32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  const auto qc = q.contiguous();
  const auto tables = block_tables.to(at::kLong).contiguous();
  const auto lens = context_lens.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head_dim or head counts do not match");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.numel() == B, "one table row and length per query");
  const int64_t G = H / KVH, W = tables.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] <= W * block_size, "a context is longer than its block table");
    TORCH_CHECK(lp[b] >= 1, "every context needs at least one token");
  }

  auto out = at::empty({B, H, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // A job is a whole sequence (each cached row read once, contiguously) when there are
  // enough sequences to keep every thread busy; otherwise one kv head of a sequence.
  const int64_t split = B >= 2 * at::get_num_threads() ? 1 : KVH;
  const int64_t heads_per_job = H / split;

  // Jobs are dealt out round-robin, not in contiguous ranges: rows usually arrive sorted by
  // context length, and a contiguous split would hand one thread all the long ones.
  const int64_t num_jobs = B * split;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_jobs));
  at::parallel_for(0, workers, 1, [&](int64_t w_begin, int64_t w_end) {
    std::vector<float> scores, acc(heads_per_job * D);
    for (int64_t w = w_begin; w < w_end; ++w) {
      for (int64_t job = w; job < num_jobs; job += workers) {
        const int64_t b = job / split, h0 = (job % split) * heads_per_job;
        const Layout lay{tp + b * W, lp[b], block_size, KVH * D, block_size * KVH * D};
        scores.resize(heads_per_job * lay.len);
        attend(qp + b * H * D, kp, vp, lay, h0, h0 + heads_per_job, G, D, fscale, scores.data(), acc.data(),
               op + b * H * D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
