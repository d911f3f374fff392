// Paged decode attention on the CPU: one query token per sequence, keys and values read in
// place from the block pool, without the gather copy the torch backend makes. fp32 queries and
// outputs; the pools are fp32, fp16 or int8 codes with per-token-per-head (step, minimum) scales.
//
// Threads split the batch by sequence; a job reads each cached token's row (all kv heads, one
// contiguous run) once for the scores and once for the values, walking the blocks in table
// order so the hardware prefetcher streams each block. Softmax is max-subtracted, in fp32.
//
// With block_mass (H2O eviction, cache/eviction/h2o.py), each row also adds the softmax mass of
// its heads per block of its table, taken from the probabilities that weigh the values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "paged_attention.h"

namespace {

using kvserve::attend;
using kvserve::Layout;
using kvserve::Pool;

// Checks shared by both entry points; returns (contiguous q, tables, lengths).
struct Checked {
  at::Tensor q, tables, lens;
};

Checked check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q must be 3-D and the caches 4-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be fp32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  Checked c{q.contiguous(), block_tables.to(at::kLong).contiguous(), context_lens.to(at::kLong).contiguous()};
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head_dim or head counts do not match");
  TORCH_CHECK(c.tables.dim() == 2 && c.tables.size(0) == B && c.lens.numel() == B,
              "one table row and length per query");
  const int64_t W = c.tables.size(1);
  const int64_t* lp = c.lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] <= W * block_size, "a context is longer than its block table");
    TORCH_CHECK(lp[b] >= 1, "every context needs at least one token");
  }
  return c;
}

// block_mass, when given: fp32 [B, >= W] (a view into a wider buffer will do); each row's mass
// per table column is added to its columns [0, W).
void check_block_mass(const std::optional<at::Tensor>& block_mass, const Checked& c) {
  if (!block_mass) return;
  const at::Tensor& m = *block_mass;
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.dim() == 2 && m.size(0) == c.q.size(0) &&
                  m.size(1) >= c.tables.size(1), "block_mass must be float32 [B, >= the table width]");
}

template <typename T>
at::Tensor run(const Checked& c, const Pool<T>& k, const Pool<T>& v, int64_t block_size, double scale,
               const std::optional<at::Tensor>& block_mass) {
  const int64_t B = c.q.size(0), H = c.q.size(1), D = c.q.size(2), KVH = k.kv_heads;
  const int64_t G = H / KVH, W = c.tables.size(1);
  auto out = at::empty({B, H, D}, c.q.options());
  const float* qp = c.q.data_ptr<float>();
  const int64_t* tp = c.tables.data_ptr<int64_t>();
  const int64_t* lp = c.lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // A job is a whole sequence (each cached row read once, contiguously) when there are
  // enough sequences to keep every thread busy; otherwise one kv head of a sequence.
  const int64_t split = B >= 2 * at::get_num_threads() ? 1 : KVH;
  const int64_t heads_per_job = H / split;

  // Jobs are dealt out round-robin, not in contiguous ranges: rows usually arrive sorted by
  // context length, and a contiguous split would hand one thread all the long ones.
  const int64_t num_jobs = B * split;
  // one row of W per job (the jobs of a row split by kv head would race on a shared one), summed
  // into block_mass after
  at::Tensor job_mass = block_mass ? at::zeros({num_jobs, W}, c.q.options()) : at::Tensor();
  float* jm = block_mass ? job_mass.data_ptr<float>() : nullptr;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_jobs));
  at::parallel_for(0, workers, 1, [&](int64_t w_begin, int64_t w_end) {
    std::vector<float> scores, acc(heads_per_job * D);
    for (int64_t w = w_begin; w < w_end; ++w) {
      for (int64_t job = w; job < num_jobs; job += workers) {
        const int64_t b = job / split, h0 = (job % split) * heads_per_job;
        const Layout lay{tp + b * W, lp[b], block_size, KVH * D, block_size * KVH * D};
        scores.resize(heads_per_job * lay.len);
        attend(qp + b * H * D, k, v, lay, h0, h0 + heads_per_job, G, D, fscale, scores.data(), acc.data(),
               op + b * H * D, jm ? jm + job * W : nullptr);
      }
    }
  });
  if (block_mass) block_mass->narrow(1, 0, W).add_(job_mass.view({B, split, W}).sum(1));
  return out;
}

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D], both fp32 or both fp16
// (widened as they are read); block_tables [B, W]; context_lens [B] >= 1. Row b attends to its
// first context_lens[b] cached tokens. -> [B, H, D] fp32. block_mass: see check_block_mass.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  const std::optional<at::Tensor>& block_mass) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_cache.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kHalf),
              "paged_decode_attention takes fp32 queries and two fp32 or two fp16 pools");
  const Checked c = check_inputs(q, k_cache, v_cache, block_tables, context_lens);
  check_block_mass(block_mass, c);
  const int64_t KVH = k_cache.size(2);
  if (dtype == at::kHalf) {
    const Pool<c10::Half> k{k_cache.data_ptr<c10::Half>(), nullptr, KVH}, v{v_cache.data_ptr<c10::Half>(), nullptr, KVH};
    return run(c, k, v, k_cache.size(1), scale, block_mass);
  }
  const Pool<float> k{k_cache.data_ptr<float>(), nullptr, KVH}, v{v_cache.data_ptr<float>(), nullptr, KVH};
  return run(c, k, v, k_cache.size(1), scale, block_mass);
}

// As paged_decode_attention over int8 pools (engine/kv/int8.py): k_codes, v_codes int8
// [num_blocks, block_size, KVH, D]; k_scale, v_scale fp32 [num_blocks, block_size, KVH, 2]
// holding (step, minimum); value = (code + 128) * step + minimum. q and the result are fp32.
at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                       const at::Tensor& v_codes, const at::Tensor& v_scale,
                                       const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                       const std::optional<at::Tensor>& block_mass) {
  TORCH_CHECK(k_codes.scalar_type() == at::kChar && v_codes.scalar_type() == at::kChar,
              "paged_decode_attention_int8 reads int8 codes");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.is_contiguous() && v_scale.is_contiguous(), "the scales must be contiguous fp32");
  const Checked c = check_inputs(q, k_codes, v_codes, block_tables, context_lens);
  check_block_mass(block_mass, c);
  const int64_t KVH = k_codes.size(2);
  const std::vector<int64_t> scale_shape{k_codes.size(0), k_codes.size(1), KVH, 2};
  TORCH_CHECK(k_scale.sizes() == scale_shape && v_scale.sizes() == scale_shape,
              "the scales must be [num_blocks, block_size, kv_heads, 2]");
  const Pool<int8_t> k{k_codes.data_ptr<int8_t>(), k_scale.data_ptr<float>(), KVH};
  const Pool<int8_t> v{v_codes.data_ptr<int8_t>(), v_scale.data_ptr<float>(), KVH};
  return run(c, k, v, k_codes.size(1), scale, block_mass);
}

// Quantize-on-write for int8 pools: rows x [T, KVH, D] (fp32) go to their flat slots
// slot_mapping [T] of codes [num_blocks, block_size, KVH, D] (int8) and scale [..., KVH, 2]:
// per row (token, head) an asymmetric range, step = (max - min) / 255, code = round((x - min) /
// step) - 128, exactly as engine/kv_quant.quantize. One call replaces ~10 small torch ops.
void write_int8_kv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "x must be fp32 [tokens, kv_heads, head_dim]");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.dim() == 4,
              "codes must be a contiguous int8 pool");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 4 && scale.size(3) == 2,
              "scale must be a contiguous fp32 [num_blocks, block_size, kv_heads, 2]");
  const int64_t T = x.size(0), KVH = x.size(1), D = x.size(2);
  TORCH_CHECK(codes.size(2) == KVH && codes.size(3) == D && scale.size(2) == KVH, "x does not match the pool");
  const auto xc = x.contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per row");
  const int64_t num_slots = codes.size(0) * codes.size(1);
  const float* xp = xc.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of range");
  at::parallel_for(0, T * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / KVH, h = r % KVH;
      const float* src = xp + r * D;
      float lo = src[0], hi = src[0];
      for (int64_t i = 1; i < D; ++i) {
        lo = std::min(lo, src[i]);
        hi = std::max(hi, src[i]);
      }
      const float step = std::max(hi - lo, 1e-8f) / 255.0f;
      int8_t* dst = cp + (sp[t] * KVH + h) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {
        const float c = std::min(std::max(std::nearbyint((src[i] - lo) / step), 0.0f), 255.0f);
        dst[i] = static_cast<int8_t>(static_cast<int32_t>(c) - 128);
      }
      float* sc = scp + (sp[t] * KVH + h) * 2;
      sc[0] = step;
      sc[1] = lo;
    }
  });
}

// The native decode layer's attention chunk (paged_attention.h kAttnChunk) for this head_dim on
// this CPU: rows of more tokens are attended in chunks of it; 0 where it never chunks.
int64_t attention_chunk_tokens(int64_t head_dim) {
  return kvserve::attend_chunks_supported(head_dim) ? kvserve::kAttnChunk : 0;
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor(a!)? block_mass=None) -> Tensor");
  m.def("paged_decode_attention_int8(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor(a!)? block_mass=None) -> Tensor");
  m.def("write_int8_kv(Tensor x, Tensor(a!) codes, Tensor(b!) scale, Tensor slot_mapping) -> ()");
  m.def("attention_chunk_tokens(int head_dim) -> int", &attention_chunk_tokens);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.impl("write_int8_kv", &write_int8_kv);
}
