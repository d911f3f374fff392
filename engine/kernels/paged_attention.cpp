// Paged decode attention on the CPU: one query token per sequence, keys and values read in
// place from the block pool, without the gather copy the torch backend makes. fp32.
//
// Threads split the batch by sequence; a job reads each cached token's row (all kv heads, one
// contiguous run) once for the scores and once for the values, walking the blocks in table
// order so the hardware prefetcher streams each block. Softmax is max-subtracted, in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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
void attend(const float* q, const float* k, const float* v, const Layout& lay, int64_t h0, int64_t h1,
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
