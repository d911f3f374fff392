// Paged decode attention on the CPU: one query token per sequence, keys and values read in
// place from the block pool, without the gather copy the torch backend makes. fp32 queries and
// outputs; the pools are fp32 or int8 codes with per-token-per-head (step, minimum) scales.
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
#include <type_traits>
#include <vector>

namespace {

struct Layout {
  const int64_t* table;  // this sequence's block ids
  int64_t len;           // cached tokens to attend to
  int64_t block_size;
  int64_t token_stride;  // elements between consecutive tokens of a block (kv_heads * head_dim)
  int64_t block_stride;  // elements between blocks
};

// One K or V pool. fp32: ``data`` holds the values. int8 (engine/kv_quant.py): ``data`` holds
// codes c in [-128, 127] and ``scale`` a (step, minimum) pair per token and kv head; the value
// is (c + 128) * step + minimum. The kernels never dequantize a row into memory: the dot
// product and the weighted sum are taken over the codes and the affine part is folded in
// per (token, head) with two scalars.
template <typename T>
struct Pool {
  const T* data;
  const float* scale;  // int8 only: [num_blocks, block_size, kv_heads, 2]
  int64_t kv_heads;
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
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

// Calls fn(slot, t) for the sequence's cached tokens t = 0 .. len-1 in order, slot being token
// t's flat index in the pool (block id * block_size + offset), block by block as the table says.
template <typename T, typename Fn>
inline void for_each_row(const Pool<T>& pool, const Layout& lay, Fn&& fn) {
  const int64_t num_blocks = (lay.len + lay.block_size - 1) / lay.block_size;
  const int64_t row_bytes = lay.token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0, t = 0; j < num_blocks; ++j) {
    const int64_t first = lay.table[j] * lay.block_size;
    const T* next = j + 1 < num_blocks ? pool.data + lay.table[j + 1] * lay.block_stride : nullptr;
    const int64_t n = std::min(lay.block_size, lay.len - j * lay.block_size);
    for (int64_t i = 0; i < n; ++i, ++t) {
      if (next) prefetch_row(next + i * lay.token_stride, row_bytes);
      fn(first + i, t);
    }
  }
}

// Heads [h0, h1) of one sequence against its cached tokens. q [H, D] (this sequence's
// queries); k/v the pools; scores is scratch [h1 - h0, len]; acc scratch [h1 - h0, D];
// out [H, D] (this sequence's output rows). Every cached token's row of those heads is read
// once, in block order.
template <typename T>
void attend(const float* q, const Pool<T>& k, const Pool<T>& v, const Layout& lay, int64_t h0, int64_t h1,
            int64_t G, int64_t D, float scale, float* scores, float* acc, float* out) {
  constexpr bool quantized = std::is_same<T, int8_t>::value;
  const int64_t L = lay.len, nh = h1 - h0, KVH = k.kv_heads;
  // int8: q . ((c + 128) step + min) = step (q . c + 128 sum(q)) + min sum(q).
  float qsum[quantized ? 64 : 1];
  std::vector<float> qsum_big;
  float* qs = qsum;
  if (quantized) {
    if (nh > 64) {
      qsum_big.resize(nh);
      qs = qsum_big.data();
    }
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = q + h * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < D; ++i) s += qh[i];
      qs[h - h0] = s;
    }
  }
  // int8 rows are widened to fp32 once per token (the kv heads this job reads) into ``row``, so
  // the G query heads sharing a kv head reuse them and the dot products stay plain fp32 loops.
  const int64_t kv0 = h0 / G, kv1 = (h1 - 1) / G + 1;
  float row_buf[quantized ? 1024 : 1];
  std::vector<float> row_big;
  float* row = row_buf;
  if (quantized && (kv1 - kv0) * D > 1024) {
    row_big.resize((kv1 - kv0) * D);
    row = row_big.data();
  }
  auto widen = [&](const T* src) -> const float* {
    if constexpr (quantized) {
      const int8_t* p = src + kv0 * D;
      const int64_t n = (kv1 - kv0) * D;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] = static_cast<float>(p[i]);
      return row - kv0 * D;
    } else {
      return src;
    }
  };
  for_each_row(k, lay, [&](int64_t slot, int64_t t) {
    const float* kt = widen(k.data + slot * lay.token_stride);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = q + h * D;
      const float* kh = kt + (h / G) * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < D; ++i) s += qh[i] * kh[i];
      if (quantized) {
        const float* sc = k.scale + (slot * KVH + h / G) * 2;
        s = sc[0] * (s + 128.f * qs[h - h0]) + sc[1] * qs[h - h0];
      }
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
  // int8: sum_t p_t ((c_t + 128) step_t + min_t) = sum_t (p_t step_t) c_t + sum_t p_t (128 step_t + min_t);
  // the second term is the same for every channel, so it is one scalar per head.
  float bias[quantized ? 64 : 1] = {};
  std::vector<float> bias_big;
  float* bs = bias;
  if (quantized && nh > 64) {
    bias_big.assign(nh, 0.f);
    bs = bias_big.data();
  }
  for_each_row(v, lay, [&](int64_t slot, int64_t t) {
    const float* vt = widen(v.data + slot * lay.token_stride);
    for (int64_t h = h0; h < h1; ++h) {
      float p = scores[(h - h0) * L + t];
      if (quantized) {
        const float* sc = v.scale + (slot * KVH + h / G) * 2;
        bs[h - h0] += p * (128.f * sc[0] + sc[1]);
        p *= sc[0];
      }
      const float* vh = vt + (h / G) * D;
      float* a = acc + (h - h0) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] += p * vh[i];
    }
  });
  if (quantized) {
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < D; ++i) acc[h * D + i] += bs[h];
  }
  std::copy(acc, acc + nh * D, out + h0 * D);
}

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

template <typename T>
at::Tensor run(const Checked& c, const Pool<T>& k, const Pool<T>& v, int64_t block_size, double scale) {
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
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_jobs));
  at::parallel_for(0, workers, 1, [&](int64_t w_begin, int64_t w_end) {
    std::vector<float> scores, acc(heads_per_job * D);
    for (int64_t w = w_begin; w < w_end; ++w) {
      for (int64_t job = w; job < num_jobs; job += workers) {
        const int64_t b = job / split, h0 = (job % split) * heads_per_job;
        const Layout lay{tp + b * W, lp[b], block_size, KVH * D, block_size * KVH * D};
        scores.resize(heads_per_job * lay.len);
        attend(qp + b * H * D, k, v, lay, h0, h0 + heads_per_job, G, D, fscale, scores.data(), acc.data(),
               op + b * H * D);
      }
    }
  });
  return out;
}

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, W];
// context_lens [B] >= 1. Row b attends to its first context_lens[b] cached tokens. -> [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "paged_decode_attention is fp32 only");
  const Checked c = check_inputs(q, k_cache, v_cache, block_tables, context_lens);
  const int64_t KVH = k_cache.size(2);
  const Pool<float> k{k_cache.data_ptr<float>(), nullptr, KVH}, v{v_cache.data_ptr<float>(), nullptr, KVH};
  return run(c, k, v, k_cache.size(1), scale);
}

// As paged_decode_attention over int8 pools (engine/kv_quant.py): k_codes, v_codes int8
// [num_blocks, block_size, KVH, D]; k_scale, v_scale fp32 [num_blocks, block_size, KVH, 2]
// holding (step, minimum); value = (code + 128) * step + minimum. q and the result are fp32.
at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                       const at::Tensor& v_codes, const at::Tensor& v_scale,
                                       const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(k_codes.scalar_type() == at::kChar && v_codes.scalar_type() == at::kChar,
              "paged_decode_attention_int8 reads int8 codes");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.is_contiguous() && v_scale.is_contiguous(), "the scales must be contiguous fp32");
  const Checked c = check_inputs(q, k_codes, v_codes, block_tables, context_lens);
  const int64_t KVH = k_codes.size(2);
  const std::vector<int64_t> scale_shape{k_codes.size(0), k_codes.size(1), KVH, 2};
  TORCH_CHECK(k_scale.sizes() == scale_shape && v_scale.sizes() == scale_shape,
              "the scales must be [num_blocks, block_size, kv_heads, 2]");
  const Pool<int8_t> k{k_codes.data_ptr<int8_t>(), k_scale.data_ptr<float>(), KVH};
  const Pool<int8_t> v{v_codes.data_ptr<int8_t>(), v_scale.data_ptr<float>(), KVH};
  return run(c, k, v, k_codes.size(1), scale);
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

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_attention_int8(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, "
        "Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("write_int8_kv(Tensor x, Tensor(a!) codes, Tensor(b!) scale, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.impl("write_int8_kv", &write_int8_kv);
}
