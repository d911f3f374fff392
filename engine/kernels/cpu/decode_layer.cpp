// One decoder layer of a decode step (every row is one new token, with its own context length
// and block table: several rows may be one sequence's consecutive tokens) in one call: RMSNorm, the
// fused QKV matmul (+ bias), RoPE, the KV write into the paged pool, paged attention, the O
// matmul (+ bias) and residual, RMSNorm, gate/up, SiLU * up, down and residual. fp32, CPU; the KV
// pools fp32 or fp16 (``--kv-cache-dtype float16``: new rows rounded to fp16 as they are written,
// as torch's ``.to(torch.float16)`` rounds them on the python path) or int4 (KIVI, kv_int4.h:
// DecodeStack only, following the step's write plan, engine/kv/int4.py's Int4Plan).
//
// Why: on a small model a decode step is ~10 small torch calls per layer, and each one pays
// dispatch plus an OpenMP fork/join, which on 2 cores costs about as much as the matmuls. Here
// a layer is ONE parallel region; its phases are worksharing loops separated by four barriers. The
// matmuls deal out one chunk of output features per thread (chunk_for), dynamically (a thread
// preempted before it takes one does not hold the others up), each chunk through the block
// kernel of its part's format (quant_linear.h) or a plain fp32 dot product for dense parts.
// Attention is the native paged kernel's per-sequence routine (paged_attention.h), one job per
// (sequence, kv head); where DecodeStack::set_chunk_tiles allows it, a chunk's rows (more than
// its `above` rows of one sequence) are one job per kv head on the AMX tiles instead
// (prefill_attention.h attend_rows_on_tiles: the Python layers' prefill numerics, bf16 q, k, v).
//
// The results equal engine/model/llama.py's DecoderLayer.forward up to fp32 summation order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "block_codes.h"
#include "cpu_features.h"  // KVSERVE_X86, cpu_has_avx2
#include "kv_int4.h"
#include "paged_attention.h"
#include "prefill_attention.h"  // attend_rows_on_tiles
#include "quant_linear.h"
#include "vec_math.h"      // silu_mul, rms_norm_row, rope_row

namespace {

constexpr int64_t kDense = -1;  // format code of a dense fp32 [rows, K] part
// Output features per work item of an N-feature matmul on `threads` threads: one item per thread,
// whole 32-feature groups (whole 8-column strips). Small items cost, as each restarts the weight
// stream and its prefetch: 32 features an item measured 3.3-3.7 ms of native layers per SmolLM2
// decode step against 2.1-2.5 at 256; and one item per thread, not two of at most 512, took
// SmolLM2's decode steps 1-8% faster at 1 to 16 rows (29 of 30 p10 / p25 / p50 comparisons, the
// two alternated in one process; docs/benchmarks.md). Items are still dealt out dynamically, so a
// thread held up by another process before it takes one leaves both to the other.
inline int64_t chunk_for(int64_t N, int threads) {
  const int64_t per = (N + threads - 1) / threads;
  return std::max<int64_t>(32, (per + 31) / 32 * 32);
}

struct Part {
  const void* data;
  int64_t rows;
  int64_t format;
};

// A (possibly fused) weight matrix [N, K]: parts stacked along the output features, each
// dense fp32 or packed blocks of one format (engine/loader/gguf/blocks.py BlockMatrix).
struct Matrix {
  std::vector<Part> parts;
  int64_t N = 0, K = 0;
  bool int8 = false;         // some part has an int8-activation kernel (quant_linear_q8.cpp) on this CPU
  unsigned q8_layouts = 0;   // the Q8Act layouts those kernels read (kvserve::q8_layouts, ORed)
};

Matrix make_matrix(at::TensorList data, at::IntArrayRef rows, at::IntArrayRef formats, int64_t K, const char* name) {
  TORCH_CHECK(!data.empty() && data.size() == rows.size() && rows.size() == formats.size(), name,
              ": one tensor, row count and format per part");
  Matrix m;
  m.K = K;
  for (size_t i = 0; i < data.size(); ++i) {
    const at::Tensor& t = data[i];
    if (formats[i] == kDense) {
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows[i] &&
                      t.size(1) == K, name, ": a dense part must be a contiguous float32 [", rows[i], ", ", K, "]");
    } else {
      TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.dim() == 2, name,
                  ": a block part must be a packed uint8 matrix (gguf_pack)");
      TORCH_CHECK(formats[i] >= 0 && formats[i] < kvserve::blocks::kNumFormats, name, ": format must be -1 (dense) or 0-",
                  kvserve::blocks::kNumFormats - 1);
      // strip formats are cut into ranges on strip boundaries
      TORCH_CHECK(!kvserve::blocks::is_strip_format(formats[i]) || m.N % 8 == 0, name,
                  ": a strip-format part must start at a multiple of 8 rows");
    }
    m.parts.push_back({t.data_ptr(), rows[i], formats[i]});
    m.N += rows[i];
    m.int8 |= kvserve::q8_supported(formats[i]);
    m.q8_layouts |= kvserve::q8_layouts(formats[i]);
  }
  return m;
}

// out[r * ldo + n - n0] = x[r] . w[n] for n in [n0, n1), w dense [*, K].
void dense_range(const float* x, int64_t M, int64_t K, const float* w, int64_t n0, int64_t n1, float* out,
                 int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * K;
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += wn[k] * xr[k];
      out[r * ldo + n - n0] = s;
    }
  }
}

// Features [n0, n1) of y = x @ W^T into y (row stride ldy, column n at y[n]). With qx (x
// quantized, int8_activations) the parts that have an int8 kernel multiply qx, the others x.
void matmul_range(const Matrix& m, const float* x, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
                  const kvserve::Q8Act* qx = nullptr) {
  int64_t off = 0;
  for (const Part& p : m.parts) {
    const int64_t a = std::max(n0, off), b = std::min(n1, off + p.rows);
    if (a < b) {
      if (p.format == kDense)
        dense_range(x, M, m.K, static_cast<const float*>(p.data), a - off, b - off, y + a, ldy);
      else if (qx && kvserve::q8_supported(p.format))
        kvserve::gguf_linear_q8_range(*qx, static_cast<const uint8_t*>(p.data), p.rows, p.format, a - off, b - off,
                                      y + a, ldy);
      else
        kvserve::gguf_linear_range(x, M, m.K, static_cast<const uint8_t*>(p.data), p.rows, p.format, a - off,
                                   b - off, y + a, ldy);
    }
    off += p.rows;
  }
}

// Inside a parallel region: y[M, N] = x @ W^T, chunks dealt out dynamically; after a chunk its
// thread runs epilogue(n0, n1) on those columns (no barrier needed: nobody else touches them).
// Ends with the worksharing loop's barrier.
template <typename Epilogue>
void matmul(const Matrix& m, const float* x, int64_t M, float* y, Epilogue&& epilogue,
            const kvserve::Q8Act* qx = nullptr) {
  const int64_t chunk = chunk_for(m.N, omp_get_num_threads());
  const int64_t chunks = (m.N + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * chunk, n1 = std::min(m.N, n0 + chunk);
    matmul_range(m, x, M, n0, n1, y, m.N, qx);
    epilogue(n0, n1);
  }
}

// Rows [0, M) of x, K each, normed into y (vec_math.h's rms_norm_row).
void rms_norm(const float* x, const float* w, int64_t M, int64_t K, float eps, float* y) {
  for (int64_t r = 0; r < M; ++r) kvserve::rms_norm_row(x + r * K, w, K, eps, y + r * K);
}

const float* optional_data(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, name,
              " must be a contiguous float32 vector of ", n);
  return t->data_ptr<float>();
}

// One decoder layer's weights, checked once: the norms, the four (fused) matrices, the biases.
// Points into tensors its owner keeps alive (decode_layer's arguments, or DecodeStack::keep).
struct LayerWeights {
  const float *input_norm = nullptr, *post_norm = nullptr, *qkv_bias = nullptr, *o_bias = nullptr;
  float eps = 0.f;
  Matrix qkv, o, gate_up, down;
  int64_t hidden = 0, I = 0;
};

LayerWeights make_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, double eps, at::TensorList qkv_w,
                        at::IntArrayRef qkv_rows, at::IntArrayRef qkv_formats, const std::optional<at::Tensor>& qkv_bias,
                        at::TensorList o_w, at::IntArrayRef o_rows, at::IntArrayRef o_formats,
                        const std::optional<at::Tensor>& o_bias, at::TensorList gate_up_w, at::IntArrayRef gate_up_rows,
                        at::IntArrayRef gate_up_formats, at::TensorList down_w, at::IntArrayRef down_rows,
                        at::IntArrayRef down_formats, int64_t hidden, int64_t H, int64_t KVH, int64_t D) {
  TORCH_CHECK(H >= KVH && KVH >= 1 && H % KVH == 0 && D % 2 == 0, "num_heads must be a multiple of the kv heads");
  const int64_t q_size = H * D, kv_size = KVH * D;
  LayerWeights l;
  l.hidden = hidden;
  l.qkv = make_matrix(qkv_w, qkv_rows, qkv_formats, hidden, "qkv");
  l.o = make_matrix(o_w, o_rows, o_formats, q_size, "o_proj");
  l.gate_up = make_matrix(gate_up_w, gate_up_rows, gate_up_formats, hidden, "gate_up");
  l.I = l.gate_up.N / 2;
  l.down = make_matrix(down_w, down_rows, down_formats, l.I, "down");
  TORCH_CHECK(l.qkv.N == q_size + 2 * kv_size && l.o.N == hidden && l.gate_up.N == 2 * l.I && l.down.N == hidden,
              "weight shapes do not match hidden ", hidden, ", ", H, "/", KVH, " heads of ", D);
  TORCH_CHECK(l.I % 8 == 0, "the intermediate size must be a multiple of 8 (up starts a strip)");
  TORCH_CHECK(input_norm.numel() == hidden && post_norm.numel() == hidden && input_norm.is_contiguous() &&
                  post_norm.is_contiguous() && input_norm.scalar_type() == at::kFloat &&
                  post_norm.scalar_type() == at::kFloat, "the norms must be contiguous float32 [hidden]");
  l.input_norm = input_norm.data_ptr<float>();
  l.post_norm = post_norm.data_ptr<float>();
  l.qkv_bias = optional_data(qkv_bias, l.qkv.N, "qkv_bias");
  l.o_bias = optional_data(o_bias, hidden, "o_bias");
  l.eps = static_cast<float>(eps);
  return l;
}

// What one decode step gives every layer: the rows, their RoPE rows, slots and block tables.
struct StepInputs {
  float* x;  // [B, hidden], updated in place layer by layer
  int64_t B, H, KVH, D, block_size, W;
  const float *cos, *sin;
  const int64_t *slots, *tables, *lens;
  float scale;
  bool int8_activations;
  // Rows read slots other rows of the step write (the rows of a multi-token chunk, e.g. a
  // speculative verify row, attend to the chunk's earlier tokens): every K/V write of a layer
  // then happens before any of its attention, behind one more barrier.
  bool writes_first = false;
  // H2O: [B * KVH, W] fp32, zeroed; the attention job (row b, kv head g) adds its heads' softmax
  // mass per table column to row b * KVH + g, every layer (one writer per row: no race).
  float* block_mass = nullptr;
  // A chunk's rows (a run of more than tile_runs_above consecutive rows of one sequence) attend on
  // the AMX tiles, prefill_attention's numerics (DecodeStack::set_chunk_tiles; fp16 / fp32 pools).
  bool chunk_tiles = false;
  int64_t tile_runs_above = 0;
};

// x [B, hidden]; cos/sin [B, head_dim] (the rows of the RoPE tables at each row's position,
// sin sign-adjusted); a cache [blocks, block_size, kv_heads, head_dim]; slots [B] the flat slot
// of each new token; block_tables [B, W] and context_lens [B] (the new token included) as
// paged_decode_attention takes them. Checks them against each other and the pool.
// pool: the pools' [blocks, block_size, kv_heads, head_dim].
StepInputs make_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::IntArrayRef pool,
                     const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
                     int64_t num_heads, double scale, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [B, hidden]");
  const int64_t B = x.size(0), block_size = pool[1], D = pool[3];
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == B && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "cos/sin must be contiguous float32 [B, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B && slots.is_contiguous() &&
                  context_lens.scalar_type() == at::kLong && context_lens.numel() == B && context_lens.is_contiguous() &&
                  block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.is_contiguous(), "slots, block_tables and context_lens must be int64, one row per token");
  const int64_t W = block_tables.size(1), num_slots = pool[0] * block_size;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < num_slots, "slot ", sp[b], " is outside the pool");
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * block_size, "a context is empty or longer than its block table");
  }
  return {x.data_ptr<float>(), B, num_heads, pool[2], D, block_size, W, cos.data_ptr<float>(),
          sin.data_ptr<float>(), sp, block_tables.data_ptr<int64_t>(), lp, static_cast<float>(scale), int8_activations};
}

StepInputs make_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                     const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
                     int64_t num_heads, double scale, bool int8_activations) {
  TORCH_CHECK(k_cache.dim() == 4 && (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf) &&
                  k_cache.is_contiguous(),
              "the caches must be contiguous float32 or float16 [blocks, block_size, kv_heads, head_dim] of one shape");
  return make_step(x, cos, sin, k_cache.sizes(), slots, block_tables, context_lens, num_heads, scale, int8_activations);
}

// k_cache and v_cache of like's shape and dtype (make_step checked like), contiguous.
void check_cache_pair(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& like) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.sizes() == like.sizes() &&
                  k_cache.scalar_type() == like.scalar_type() && v_cache.scalar_type() == like.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches must be contiguous [blocks, block_size, kv_heads, head_dim] of one shape and one dtype");
}

// A new K or V row into the pool: copied (fp32) or rounded to nearest even (fp16; F16C eight at a
// time where the CPU has it, the same rounding as c10::Half's scalar one, which had cost ~2% of a
// 16-row decode step).
inline void store_row(const float* src, int64_t D, float* dst) { std::copy(src, src + D, dst); }
#ifdef KVSERVE_X86
__attribute__((target("avx2,f16c"))) inline int64_t store_halves_f16c(const float* src, int64_t D, c10::Half* dst) {
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  return i;
}
#endif
inline void store_row(const float* src, int64_t D, c10::Half* dst) {
  int64_t i = 0;
#ifdef KVSERVE_X86
  if (kvserve::cpu_has_avx2()) i = store_halves_f16c(src, D, dst);
#endif
  for (; i < D; ++i) dst[i] = c10::Half(src[i]);
}

// The attention phase's work items, the same for every layer of a step. A row of at most
// kvserve::kAttnChunk tokens (or any row, where chunks are off) is one item per kv head: its G
// query heads over the whole context, written to the row's output; or, where the step has whole
// rows (at least two such rows a thread), one item of every head. A longer row is one item per
// chunk of kAttnChunk tokens over every head (paged_attention.h attend_chunk), written to `part`,
// and a merge phase (merge_chunks) then gives its output. Chunks are off for int4 pools (their
// kernel, kv_int4.h, has none), with H2O's block mass (exported per kv head) and where the AVX2
// kernel does not run (attend_chunks_supported).
struct AttentionPlan {
  static constexpr int64_t kEveryHead = -2;  // Item::head of a whole row's item
  struct Item {
    int64_t row, head;    // head: the kv head (whole-context items), kEveryHead, or -1 (a chunk of every head)
    int64_t t0, t1, part; // a chunk's tokens and its index into part / stats
    int64_t rows = 0;     // > 0: rows [row, row + rows), one sequence's, of kv head `head` on the tiles
  };
  std::vector<Item> items;
  std::vector<int64_t> chunked_rows;  // the rows attended in chunks
  std::vector<int64_t> first_part;    // [B + 1]: row b's chunks are parts [first_part[b], first_part[b + 1])
  int64_t parts = 0;

  // whole_rows: whether a row may be one item of every head (not with int4 pools, whose kernel
  // takes one kv head, nor with H2O's mass, exported per kv head). Taken where the step has at
  // least two rows a thread: a row's heads then read its K and V rows whole, as they lie in the
  // pool, where the kv heads' items read a third of each (SmolLM2) on two cores at once. SmolLM2
  // Q4_1's in-process steps, five alternated pairs: 16 rows 4-19% faster (median 9%), 8 rows 1-29%
  // (9%), 4 rows within the noise (docs/benchmarks.md, "a twenty-second session"). Below two rows a
  // thread, the kv heads' items keep both threads busy.
  void plan(const StepInputs& in, bool chunks, bool whole_rows) {
    items.clear(), chunked_rows.clear(), first_part.assign(in.B + 1, 0), parts = 0;
    const bool whole = whole_rows && in.B >= 2 * at::get_num_threads();
    for (int64_t b = 0; b < in.B; ++b) {
      const int64_t len = in.lens[b];
      first_part[b] = parts;
      const bool tiles = in.chunk_tiles && in.writes_first;  // a chunk's rows only come with writes_first
      const int64_t run = tiles ? sequence_run(in, b) : 1;
      if (tiles && run > in.tile_runs_above) {
        for (int64_t g = 0; g < in.KVH; ++g) items.push_back({b, g, 0, 0, -1, run});
        for (int64_t r = b + 1; r < b + run; ++r) first_part[r] = parts;
        b += run - 1;
        continue;
      }
      if (whole && (!chunks || len <= kvserve::kAttnChunk)) {
        items.push_back({b, kEveryHead, 0, len, -1});
        continue;
      }
      if (!chunks || len <= kvserve::kAttnChunk) {
        for (int64_t g = 0; g < in.KVH; ++g) items.push_back({b, g, 0, len, -1});
        continue;
      }
      chunked_rows.push_back(b);
      for (int64_t t0 = 0; t0 < len; t0 += kvserve::kAttnChunk)
        items.push_back({b, -1, t0, std::min(len, t0 + kvserve::kAttnChunk), parts++});
    }
    first_part[in.B] = parts;
  }

  // How many rows from b on are one sequence's consecutive tokens: each the next position (its
  // length one more) over the same block table.
  static int64_t sequence_run(const StepInputs& in, int64_t b) {
    int64_t r = b + 1;
    while (r < in.B && in.lens[r] == in.lens[r - 1] + 1 &&
           std::equal(in.tables + b * in.W, in.tables + b * in.W + (in.lens[r] + in.block_size - 1) / in.block_size,
                      in.tables + r * in.W))
      ++r;
    return r - b;
  }
};

// The step's buffers between phases, shared by the threads: sized for the largest layer.
struct SharedScratch {
  std::vector<float> data;
  float *qkv, *attn, *tmp, *gu, *act;  // [B, qkv.N], [B, q_size], [B, hidden] O / down products, [B, 2I], [B, I]
  float *part, *stats;                 // [parts, q_size] the chunks' unnormalized sums, [parts, 2 H] their softmax stats
  AttentionPlan attention;
  // every_head: whether an item may take every head of a row (long rows' chunks, whole rows; see
  // AttentionPlan): not over int4 pools nor with H2O's mass
  void size_for(const LayerWeights& l, const StepInputs& in, bool every_head) {
    attention.plan(in, every_head && kvserve::attend_chunks_supported(in.D), every_head);
    const int64_t B = in.B, q_size = in.H * in.D, P = attention.parts;
    data.resize(B * (l.qkv.N + q_size + l.hidden + 3 * l.I) + P * (q_size + 2 * in.H));
    qkv = data.data(), attn = qkv + B * l.qkv.N, tmp = attn + B * q_size, gu = tmp + B * l.hidden, act = gu + B * 2 * l.I;
    part = act + B * l.I, stats = part + P * q_size;
  }
};

// One thread's buffers.
struct ThreadScratch {
  std::vector<float> y, head, scores, acc;
  kvserve::Q8Act qx;
  std::vector<const float*> rows;  // an int4 block's token rows, as it is quantized
};

// One step over int4 pools (DecodeStack::int4_step): every layer's pools and the step's write
// plan (engine/kv/int4.py Int4Plan) resolved per row. A row's K/V go to its residual row; the
// blocks the step completes are quantized, per KV head, before any row attends to them: by the
// job of the row that completes the block (its owner) when rows read only their own writes, in
// a phase of their own after the writes otherwise (writes_first).
struct Int4Step {
  struct Block {
    int64_t block, slot;  // slot -1: filled by this step alone, quantized from its rows' K/V
    const int64_t* rows;  // such a block's block_size rows of the step, in offset order
  };
  std::vector<kvserve::Int4Pools> layers;
  std::vector<int64_t> row_res;      // [B]: the flat residual row (slot * block_size + offset) row b writes, or -1
  std::vector<int64_t> owner_block;  // [B]: the index in `blocks` of the block row b completes, or -1
  std::vector<Block> blocks;
};

// Block q of the step, KV head g, quantized (kv_int4.h) from the residual or the step's K/V rows.
void quantize_block(const Int4Step& q4, const kvserve::Int4Pools& p, int64_t q, int64_t g, const float* qkv,
                    int64_t ldq, int64_t H, std::vector<const float*>& rows) {
  const Int4Step::Block& b = q4.blocks[q];
  const int64_t bs = p.bs, KVH = p.KVH, D = p.D;
  rows.resize(bs);
  for (int pass = 0; pass < 2; ++pass) {
    const float* res = pass == 0 ? p.kr : p.vr;
    const int64_t head = pass == 0 ? H + g : H + KVH + g;
    for (int64_t i = 0; i < bs; ++i)
      rows[i] = b.slot >= 0 ? res + ((b.slot * bs + i) * KVH + g) * D : qkv + b.rows[i] * ldq + head * D;
    if (pass == 0)
      kvserve::quantize_key_block(p, b.block, g, rows.data());
    else
      for (int64_t i = 0; i < bs; ++i) kvserve::quantize_value_row(p, b.block, i, g, rows[i]);
  }
}

// One layer, run by every thread of the enclosing parallel region; ends with a barrier, after
// which in.x holds the layer's output. `s` must be sized for this layer (SharedScratch::size_for,
// before the region).
//
// Four barriers: each phase reads what all threads wrote in the one before it. The norms are
// computed by every thread into its own copy (no barrier of their own); a row's RoPE and KV
// write happen in the attention job that reads them (with writes_first, in a phase of their own
// before it: a fifth barrier); SiLU * up in the gate/up chunk that computed both halves.
//
// int4 pools (T = uint8_t, kp / vp their codes): q4 is the step, p4 this layer's pools.
template <typename T>
void run_layer(const LayerWeights& l, const StepInputs& in, T* kp, T* vp, const SharedScratch& s, ThreadScratch& ts,
               const Int4Step* q4 = nullptr, const kvserve::Int4Pools* p4 = nullptr) {
  constexpr bool int4 = std::is_same<T, uint8_t>::value;
  const int64_t B = in.B, hidden = l.hidden, I = l.I, H = in.H, KVH = in.KVH, D = in.D, G = H / KVH;
  const int64_t q_size = H * D;
  float* xp = in.x;
  const kvserve::Pool<T> k_pool{kp, nullptr, KVH}, v_pool{vp, nullptr, KVH};
  ts.y.resize(B * hidden), ts.head.resize(D), ts.acc.resize(H * D);  // H: a whole row's item (kEveryHead)
  // int8_activations: each matmul input is quantized once per thread (a few microseconds;
  // cheaper than another barrier) for the parts that have an int8 kernel
  const auto quantized = [&](const Matrix& m, const float* x, int64_t K) -> const kvserve::Q8Act* {
    if (!in.int8_activations || !m.int8) return nullptr;
    ts.qx.quantize(x, B, K, m.q8_layouts);
    return &ts.qx;
  };
  const auto add_residual = [&](const float* bias) {
    return [&, bias](int64_t n0, int64_t n1) {
      for (int64_t r = 0; r < B; ++r)
        for (int64_t n = n0; n < n1; ++n) xp[r * hidden + n] += bias ? s.tmp[r * hidden + n] + bias[n] : s.tmp[r * hidden + n];
    };
  };
  // bias, then RoPE (q and k heads), of head h of row b's fused qkv output
  const auto prepare_head = [&](int64_t b, int64_t h) {
    float* v = s.qkv + b * l.qkv.N + h * D;
    if (l.qkv_bias)
      for (int64_t i = 0; i < D; ++i) v[i] += l.qkv_bias[h * D + i];
    if (h < H + KVH) kvserve::rope_row(v, in.cos + b * D, in.sin + b * D, D, ts.head.data());
    return v;
  };

  float* y = ts.y.data();
  rms_norm(xp, l.input_norm, B, hidden, l.eps, y);
  matmul(l.qkv, y, B, s.qkv, [](int64_t, int64_t) {}, quantized(l.qkv, y, hidden));
  // a (row, kv head)'s G query heads, key and value: bias, RoPE, and the K/V write into the pool
  const auto prepare_job = [&](int64_t b, int64_t g) {
    for (int64_t h = g * G; h < (g + 1) * G; ++h) prepare_head(b, h);
    const float* k_new = prepare_head(b, H + g);
    const float* v_new = prepare_head(b, H + KVH + g);
    if constexpr (int4) {
      const int64_t r = q4->row_res[b];  // -1: a row of a block the step fills alone, quantized from qkv
      if (r >= 0) {
        std::copy(k_new, k_new + D, p4->kr + (r * KVH + g) * D);
        std::copy(v_new, v_new + D, p4->vr + (r * KVH + g) * D);
      }
    } else {
      store_row(k_new, D, kp + (in.slots[b] * KVH + g) * D);
      store_row(v_new, D, vp + (in.slots[b] * KVH + g) * D);
    }
  };
  // chunked rows: every chunk of a row reads its roped queries, and the last one its new K/V
  const bool chunked = !s.attention.chunked_rows.empty();
  if (in.writes_first || chunked) {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < B * KVH; ++job) prepare_job(job / KVH, job % KVH);
    if constexpr (int4) {
      const int64_t jobs = static_cast<int64_t>(q4->blocks.size()) * KVH;
      if (jobs) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; ++job) quantize_block(*q4, *p4, job / KVH, job % KVH, s.qkv, l.qkv.N, H, ts.rows);
      }
    }
  }
  // attention: the plan's items (a row's G query heads of one kv head, or a chunk of a row)
  const std::vector<AttentionPlan::Item>& items = s.attention.items;
#pragma omp for schedule(dynamic, 1)
  for (int64_t job = 0; job < static_cast<int64_t>(items.size()); ++job) {
    const int64_t b = items[job].row, g = items[job].head;
    if constexpr (!int4) {
      if (items[job].rows > 0) {  // a chunk's rows on the tiles (their K/V are in the pool: writes_first)
        const int64_t n = items[job].rows;
        const kvserve::PagedRows<T> rows{kp, vp, in.tables + b * in.W, in.block_size, KVH * D, g * D};
        kvserve::attend_rows_on_tiles(s.qkv + b * l.qkv.N + g * G * D, l.qkv.N, G, D, rows, in.lens[b] - 1, n, in.scale,
                                      s.attn + b * q_size + g * G * D, q_size);
        continue;
      }
      if (g == AttentionPlan::kEveryHead) {  // a whole row
        if (!in.writes_first && !chunked)
          for (int64_t kv = 0; kv < KVH; ++kv) prepare_job(b, kv);
        const kvserve::Layout lay{in.tables + b * in.W, in.lens[b], in.block_size, KVH * D, in.block_size * KVH * D};
        ts.scores.resize(H * lay.len);
        kvserve::attend(s.qkv + b * l.qkv.N, k_pool, v_pool, lay, 0, H, G, D, in.scale, ts.scores.data(),
                        ts.acc.data(), s.attn + b * q_size);
        continue;
      }
      if (g < 0) {  // a chunk: its tokens, every head
        const AttentionPlan::Item& it = items[job];
        const kvserve::Layout lay{in.tables + b * in.W, in.lens[b], in.block_size, KVH * D, in.block_size * KVH * D};
        ts.scores.resize(H * (it.t1 - it.t0));
        kvserve::attend_chunk(s.qkv + b * l.qkv.N, k_pool, v_pool, lay, H, G, D, in.scale, it.t0, it.t1,
                              ts.scores.data(), s.part + it.part * q_size, s.stats + it.part * 2 * H);
        continue;
      }
    }
    if (!in.writes_first && !chunked) {
      prepare_job(b, g);
      if constexpr (int4) {
        if (q4->owner_block[b] >= 0) quantize_block(*q4, *p4, q4->owner_block[b], g, s.qkv, l.qkv.N, H, ts.rows);
      }
    }
    if constexpr (int4) {
      kvserve::attend_int4(s.qkv + b * l.qkv.N, *p4, in.tables + b * in.W, in.lens[b], g, G, in.scale,
                           s.attn + b * q_size, ts.scores, ts.acc);
    } else {
      const kvserve::Layout lay{in.tables + b * in.W, in.lens[b], in.block_size, KVH * D, in.block_size * KVH * D};
      ts.scores.resize(G * lay.len);
      kvserve::attend(s.qkv + b * l.qkv.N, k_pool, v_pool, lay, g * G, (g + 1) * G, G, D, in.scale, ts.scores.data(),
                      ts.acc.data(), s.attn + b * q_size, in.block_mass ? in.block_mass + (b * KVH + g) * in.W : nullptr);
    }
  }
  if (chunked) {
    const std::vector<int64_t>& rows = s.attention.chunked_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) {
      const int64_t b = rows[i], p0 = s.attention.first_part[b];
      kvserve::merge_chunks(s.part + p0 * q_size, s.stats + p0 * 2 * H, s.attention.first_part[b + 1] - p0, q_size, H,
                            D, s.attn + b * q_size);
    }
  }
  matmul(l.o, s.attn, B, s.tmp, add_residual(l.o_bias), quantized(l.o, s.attn, q_size));
  rms_norm(xp, l.post_norm, B, hidden, l.eps, y);
  const kvserve::Q8Act* qy = quantized(l.gate_up, y, hidden);
  // gate and up features [j0, j1) together, then act = SiLU(gate) * up on them
  const int64_t gu_chunk = chunk_for(I, omp_get_num_threads());
#pragma omp for schedule(dynamic, 1)
  for (int64_t c = 0; c < (I + gu_chunk - 1) / gu_chunk; ++c) {
    const int64_t j0 = c * gu_chunk, j1 = std::min(I, j0 + gu_chunk);
    matmul_range(l.gate_up, y, B, j0, j1, s.gu, 2 * I, qy);
    matmul_range(l.gate_up, y, B, I + j0, I + j1, s.gu, 2 * I, qy);
    for (int64_t r = 0; r < B; ++r) kvserve::silu_mul(s.gu + r * 2 * I + j0, s.gu + r * 2 * I + I + j0, j1 - j0, s.act + r * I + j0);
  }
  matmul(l.down, s.act, B, s.tmp, add_residual(nullptr), quantized(l.down, s.act, I));
}

// One layer of a decode step (see the file comment); x is updated in place. The weights'
// arguments are those of engine/model/llama.py DecoderLayer.native_decode_args.
void decode_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                  at::TensorList qkv_w, at::IntArrayRef qkv_rows, at::IntArrayRef qkv_formats,
                  const std::optional<at::Tensor>& qkv_bias, at::TensorList o_w, at::IntArrayRef o_rows,
                  at::IntArrayRef o_formats, const std::optional<at::Tensor>& o_bias, at::TensorList gate_up_w,
                  at::IntArrayRef gate_up_rows, at::IntArrayRef gate_up_formats, at::TensorList down_w,
                  at::IntArrayRef down_rows, at::IntArrayRef down_formats, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads, double scale,
                  bool int8_activations) {
  const StepInputs in = make_step(x, cos, sin, k_cache, slots, block_tables, context_lens, num_heads, scale,
                                  int8_activations);
  check_cache_pair(k_cache, v_cache, k_cache);
  const LayerWeights l = make_layer(input_norm, post_norm, eps, qkv_w, qkv_rows, qkv_formats, qkv_bias, o_w, o_rows,
                                    o_formats, o_bias, gate_up_w, gate_up_rows, gate_up_formats, down_w, down_rows,
                                    down_formats, x.size(1), in.H, in.KVH, in.D);
  // scratch, reused across calls (one decode step runs layer after layer on one thread)
  // (a thread_local named inside the region would be each thread's own: pass the caller's by address)
  static thread_local SharedScratch scratch;
  SharedScratch* shared = &scratch;
  shared->size_for(l, in, /*every_head=*/true);
  const auto each_thread = [&](auto* kp, auto* vp) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      static thread_local ThreadScratch ts;
      run_layer(l, in, kp, vp, *shared, ts);
    }
  };
  if (k_cache.scalar_type() == at::kHalf)
    each_thread(k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>());
  else
    each_thread(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}

// Every decoder layer of a model, bound once (engine/model/llama.py binds it with the layers'
// native_decode_args), run for a decode step as ONE parallel region: the same work as one
// decode_layer call per layer, without a Python call, an operator dispatch and a thread
// fork/join per layer (~25 us a layer on 2 cores, ~7% of a 135M model's token).
struct DecodeStack : torch::CustomClassHolder {
  std::vector<LayerWeights> layers;
  std::vector<at::Tensor> keep;  // the tensors the layers point into
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  at::Tensor norm;  // the model's final RMSNorm weight (set_final_norm), or undefined
  float norm_eps = 0.f;
  bool chunk_tiles = false;  // set_chunk_tiles
  int64_t tile_runs_above = 0;
  std::vector<at::Tensor> int4_next;  // int4_step's tensors, for the next run
  std::vector<at::Tensor> int4_keep;  // the current run's

  DecodeStack(int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim_)
      : hidden(hidden_size), heads(num_heads), kv_heads(num_kv_heads), head_dim(head_dim_) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps, std::vector<at::Tensor> qkv_w,
                 std::vector<int64_t> qkv_rows, std::vector<int64_t> qkv_formats, std::optional<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> o_w, std::vector<int64_t> o_rows, std::vector<int64_t> o_formats,
                 std::optional<at::Tensor> o_bias, std::vector<at::Tensor> gate_up_w, std::vector<int64_t> gate_up_rows,
                 std::vector<int64_t> gate_up_formats, std::vector<at::Tensor> down_w, std::vector<int64_t> down_rows,
                 std::vector<int64_t> down_formats) {
    layers.push_back(make_layer(input_norm, post_norm, eps, qkv_w, qkv_rows, qkv_formats, qkv_bias, o_w, o_rows,
                                o_formats, o_bias, gate_up_w, gate_up_rows, gate_up_formats, down_w, down_rows,
                                down_formats, hidden, heads, kv_heads, head_dim));
    for (auto* list : {&qkv_w, &o_w, &gate_up_w, &down_w}) keep.insert(keep.end(), list->begin(), list->end());
    keep.push_back(input_norm), keep.push_back(post_norm);
    if (qkv_bias) keep.push_back(*qkv_bias);
    if (o_bias) keep.push_back(*o_bias);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // Whether a chunk's rows (more than `above` of one sequence in a step; fewer, e.g. speculative
  // verify rows, keep the decode kernel) attend on the AMX tiles (prefill_attention.h
  // attend_rows_on_tiles), over fp16 or fp32 pools without H2O's mass; where the CPU or the head size
  // does not allow it, they stay on the decode kernel. Returns whether they will.
  bool set_chunk_tiles(bool on, int64_t above) {
    TORCH_CHECK(above >= 0, "set_chunk_tiles: above must be >= 0");
    chunk_tiles = on && kvserve::rows_on_tiles_supported(head_dim);
    tile_runs_above = above;
    return chunk_tiles;
  }

  // The model's final RMSNorm, which run() applies after the last layer when asked to.
  void set_final_norm(at::Tensor weight, double eps) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == hidden,
                "the final norm must be a contiguous float32 [hidden]");
    norm = weight, norm_eps = static_cast<float>(eps);
  }

  // The next run's pools are int4 (engine/kv/int4.py; run's k_caches / v_caches are then each
  // layer's codes): each layer's scales and residuals, the pool's slot_of, and the step's write
  // plan (Int4Plan's tensors, for the run's rows). Taken by that run.
  void int4_step(std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales,
                 std::vector<at::Tensor> k_residuals, std::vector<at::Tensor> v_residuals, at::Tensor slot_of,
                 at::Tensor res_rows, at::Tensor res_slots, at::Tensor direct_blocks, at::Tensor direct_rows,
                 at::Tensor done_blocks, at::Tensor done_slots) {
    TORCH_CHECK(k_scales.size() == layers.size() && v_scales.size() == layers.size() &&
                    k_residuals.size() == layers.size() && v_residuals.size() == layers.size(),
                "int4_step: one K and one V scale and residual per layer (", layers.size(), " layers)");
    int4_next.clear();
    for (auto* list : {&k_scales, &v_scales, &k_residuals, &v_residuals})
      int4_next.insert(int4_next.end(), list->begin(), list->end());
    int4_next.insert(int4_next.end(), {slot_of, res_rows, res_slots, direct_blocks, direct_rows, done_blocks, done_slots});
  }

  // int4_next (int4_step) over the codes k_caches / v_caches for a step of `in`'s rows, checked.
  Int4Step take_int4_step(const StepInputs& in, const std::vector<at::Tensor>& k_codes,
                          const std::vector<at::Tensor>& v_codes, bool writes_first) {
    TORCH_CHECK(!int4_next.empty(), "int4 pools: call int4_step before each run");
    std::vector<at::Tensor> a;
    a.swap(int4_next);
    const size_t L = layers.size();
    const at::Tensor& codes = k_codes[0];
    const int64_t N = codes.size(0), bs = in.block_size, KVH = in.KVH, D = in.D, B = in.B;
    const at::Tensor& res0 = a[2 * L];
    const int64_t R = res0.size(0);
    const auto is = [](const at::Tensor& t, at::ScalarType type, std::vector<int64_t> shape) {
      return t.scalar_type() == type && t.is_contiguous() && t.sizes() == at::IntArrayRef(shape);
    };
    Int4Step q4;
    for (size_t i = 0; i < L; ++i) {
      const at::Tensor &kc = k_codes[i], &vc = v_codes[i], &ks = a[i], &vs = a[L + i], &kr = a[2 * L + i],
                       &vr = a[3 * L + i];
      TORCH_CHECK(is(kc, at::kByte, {N, bs, KVH, D / 2}) && is(vc, at::kByte, {N, bs, KVH, D / 2}),
                  "int4 pools: the codes must be contiguous uint8 [blocks, block_size, kv_heads, head_dim / 2] of one shape");
      TORCH_CHECK(is(ks, at::kHalf, {N, KVH, 2, D}) && is(vs, at::kHalf, {N, bs, KVH, 2}),
                  "int4 pools: the scales must be contiguous fp16 [blocks, kv_heads, 2, head_dim] (K) and "
                  "[blocks, block_size, kv_heads, 2] (V)");
      TORCH_CHECK(is(kr, at::kFloat, {R, bs, KVH, D}) && is(vr, at::kFloat, {R, bs, KVH, D}),
                  "int4 pools: the residuals must be contiguous float32 [slots, block_size, kv_heads, head_dim]");
      q4.layers.push_back({kc.data_ptr<uint8_t>(), ks.data_ptr<c10::Half>(), vc.data_ptr<uint8_t>(),
                           vs.data_ptr<c10::Half>(), kr.data_ptr<float>(), vr.data_ptr<float>(), nullptr, bs, KVH, D});
    }
    const at::Tensor &slot_of = a[4 * L], &res_rows = a[4 * L + 1], &res_slots = a[4 * L + 2],
                     &direct_blocks = a[4 * L + 3], &direct_rows = a[4 * L + 4], &done_blocks = a[4 * L + 5],
                     &done_slots = a[4 * L + 6];
    TORCH_CHECK(is(slot_of, at::kInt, {N}), "int4 pools: slot_of must be a contiguous int32 [blocks]");
    const int32_t* so = slot_of.data_ptr<int32_t>();
    for (auto& p : q4.layers) p.slot_of = so;
    const int64_t n_res = res_rows.numel(), n_direct = direct_blocks.numel(), n_done = done_blocks.numel();
    TORCH_CHECK(is(res_rows, at::kLong, {n_res}) && is(res_slots, at::kLong, {n_res}) &&
                    is(direct_blocks, at::kLong, {n_direct}) && is(direct_rows, at::kLong, {n_direct, bs}) &&
                    is(done_blocks, at::kLong, {n_done}) && is(done_slots, at::kLong, {n_done}),
                "int4 pools: the plan must be contiguous int64 (Int4Plan's tensors)");
    q4.row_res.assign(B, -1);
    q4.owner_block.assign(B, -1);
    std::vector<int> placed(B, 0);
    const int64_t *rr = res_rows.data_ptr<int64_t>(), *rs = res_slots.data_ptr<int64_t>();
    const int64_t *db = direct_blocks.data_ptr<int64_t>(), *dr = direct_rows.data_ptr<int64_t>();
    const int64_t *fb = done_blocks.data_ptr<int64_t>(), *fs = done_slots.data_ptr<int64_t>();
    for (int64_t j = 0; j < n_res; ++j) {
      TORCH_CHECK(rr[j] >= 0 && rr[j] < B && rs[j] >= 0 && rs[j] < R * bs, "int4 pools: a plan row or residual slot is out of range");
      q4.row_res[rr[j]] = rs[j], ++placed[rr[j]];
    }
    for (int64_t j = 0; j < n_done; ++j) {
      TORCH_CHECK(fb[j] >= 0 && fb[j] < N && fs[j] >= 0 && fs[j] < R, "int4 pools: a completed block or its slot is out of range");
      int64_t owner = -1;  // the row writing the block's last offset
      for (int64_t r = 0; r < B; ++r)
        if (q4.row_res[r] == fs[j] * bs + bs - 1) owner = r;
      TORCH_CHECK(owner >= 0, "int4 pools: no row of the step completes block ", fb[j]);
      q4.owner_block[owner] = static_cast<int64_t>(q4.blocks.size());
      q4.blocks.push_back({fb[j], fs[j], nullptr});
    }
    for (int64_t j = 0; j < n_direct; ++j) {
      TORCH_CHECK(db[j] >= 0 && db[j] < N, "int4 pools: a block is out of range");
      TORCH_CHECK(writes_first || bs == 1, "int4 pools: a block filled by one step's rows needs writes_first");
      int64_t owner = 0;
      for (int64_t i = 0; i < bs; ++i) {
        const int64_t r = dr[j * bs + i];
        TORCH_CHECK(r >= 0 && r < B, "int4 pools: a plan row is out of range");
        ++placed[r], owner = std::max(owner, r);
      }
      q4.owner_block[owner] = static_cast<int64_t>(q4.blocks.size());
      q4.blocks.push_back({db[j], -1, dr + j * bs});
    }
    for (int64_t r = 0; r < B; ++r) TORCH_CHECK(placed[r] == 1, "int4 pools: the plan places row ", r, " ", placed[r], " times");
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < (in.lens[b] + bs - 1) / bs; ++j) {
        const int64_t blk = in.tables[b * in.W + j];
        TORCH_CHECK(blk >= 0 && blk < N && so[blk] < R, "int4 pools: a block or its residual slot is out of range");
      }
    int4_keep = std::move(a);  // the plan's rows are read during the run
    return q4;
  }

  // x [B, hidden] through every layer in place; k_caches[i] / v_caches[i] layer i's pools. With
  // final_norm, then through the model's final RMSNorm (set_final_norm), in the same region.
  // writes_first: some row reads a slot another row of the step writes (StepInputs).
  // block_mass (H2O), fp32 [B, >= W]: each row's softmax mass per table column, summed over
  // heads and layers, is added to its columns [0, W).
  void run(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
           std::vector<at::Tensor> v_caches, at::Tensor slots, at::Tensor block_tables, at::Tensor context_lens,
           double scale, bool int8_activations, bool final_norm, bool writes_first,
           std::optional<at::Tensor> block_mass) {
    TORCH_CHECK(!final_norm || norm.defined(), "run(final_norm=True) needs set_final_norm first");
    TORCH_CHECK(!layers.empty() && k_caches.size() == layers.size() && v_caches.size() == layers.size(),
                "one K and one V cache per layer (", layers.size(), " layers)");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden, "x must be [B, ", hidden, "]");
    const bool int4 = k_caches[0].scalar_type() == at::kByte;
    TORCH_CHECK(!int4 || k_caches[0].dim() == 4, "int4 pools: the codes must be [blocks, block_size, kv_heads, head_dim / 2]");
    StepInputs in = int4 ? make_step(x, cos, sin, {k_caches[0].size(0), k_caches[0].size(1), k_caches[0].size(2),
                                                   2 * k_caches[0].size(3)},
                                     slots, block_tables, context_lens, heads, scale, int8_activations)
                         : make_step(x, cos, sin, k_caches[0], slots, block_tables, context_lens, heads, scale,
                                     int8_activations);
    in.writes_first = writes_first;
    in.chunk_tiles = chunk_tiles && !int4 && !block_mass;
    in.tile_runs_above = tile_runs_above;
    TORCH_CHECK(in.KVH == kv_heads && in.D == head_dim, "the caches hold ", in.KVH, " kv heads of ", in.D,
                ", the layers ", kv_heads, " of ", head_dim);
    std::optional<Int4Step> q4;
    if (int4)
      q4 = take_int4_step(in, k_caches, v_caches, writes_first);
    else
      for (size_t i = 0; i < layers.size(); ++i) check_cache_pair(k_caches[i], v_caches[i], k_caches[0]);
    TORCH_CHECK(int4 || int4_next.empty(), "int4_step was called, but the pools are not int4 codes");
    static thread_local SharedScratch scratch;  // the caller's, passed by address (see decode_layer)
    SharedScratch* shared = &scratch;
    shared->size_for(*std::max_element(layers.begin(), layers.end(), [](const LayerWeights& a, const LayerWeights& b) {
      return a.qkv.N + 3 * a.I < b.qkv.N + 3 * b.I;
    }), in, /*every_head=*/!int4 && !block_mass);
    const float* w = final_norm ? norm.data_ptr<float>() : nullptr;
    at::Tensor job_mass;
    if (block_mass) {
      // int4 attention (kv_int4.h) does not export mass: h2o is refused with int4 pools (builder)
      TORCH_CHECK(!q4, "block_mass is not exported from int4 pools");
      TORCH_CHECK(block_mass->scalar_type() == at::kFloat && block_mass->dim() == 2 && block_mass->size(0) == in.B &&
                      block_mass->size(1) >= in.W, "block_mass must be float32 [B, >= the table width]");
      job_mass = at::zeros({in.B * in.KVH, in.W}, x.options());
      in.block_mass = job_mass.data_ptr<float>();
    }
    if (q4)
      run_layers<uint8_t>(in, k_caches, v_caches, *shared, w, &*q4);
    else if (k_caches[0].scalar_type() == at::kHalf)
      run_layers<c10::Half>(in, k_caches, v_caches, *shared, w);
    else
      run_layers<float>(in, k_caches, v_caches, *shared, w);
    if (block_mass) block_mass->narrow(1, 0, in.W).add_(job_mass.view({in.B, in.KVH, in.W}).sum(1));
  }

  template <typename T>
  void run_layers(const StepInputs& in, const std::vector<at::Tensor>& k_caches,
                  const std::vector<at::Tensor>& v_caches, const SharedScratch& shared, const float* final_norm,
                  const Int4Step* q4 = nullptr) const {
    std::vector<T*> kp(layers.size()), vp(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) kp[i] = k_caches[i].data_ptr<T>(), vp[i] = v_caches[i].data_ptr<T>();
#pragma omp parallel num_threads(at::get_num_threads())
    {
      static thread_local ThreadScratch ts;
      for (size_t i = 0; i < layers.size(); ++i)
        run_layer(layers[i], in, kp[i], vp[i], shared, ts, q4, q4 ? &q4->layers[i] : nullptr);
      if (final_norm) {
#pragma omp for
        for (int64_t r = 0; r < in.B; ++r) rms_norm(in.x + r * hidden, final_norm, 1, hidden, norm_eps, in.x + r * hidden);
      }
    }
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_final_norm", &DecodeStack::set_final_norm)
      .def("set_chunk_tiles", &DecodeStack::set_chunk_tiles)
      .def("int4_step", &DecodeStack::int4_step)
      .def("run", &DecodeStack::run);
  m.def("decode_layer(Tensor(a!) x, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor[] qkv, int[] qkv_rows, int[] qkv_formats, Tensor? qkv_bias, "
        "Tensor[] o_proj, int[] o_rows, int[] o_formats, Tensor? o_bias, "
        "Tensor[] gate_up, int[] gate_up_rows, int[] gate_up_formats, "
        "Tensor[] down, int[] down_rows, int[] down_formats, "
        "Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, int num_heads, float scale, bool int8_activations=False) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_layer", &decode_layer); }
