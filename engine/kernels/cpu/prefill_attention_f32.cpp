// A prefill chunk's attention in fp32 on AVX2 + FMA (every x86 CPU the int8 kernels run on), one
// call per chunk, prefill_attention.h's contract: q, k and v are read as fp32 (fp16 and bf16 inputs
// widened exactly); every product, sum and the softmax are fp32. prefill_attention.cpp is the same
// contract on AMX-BF16 tiles, for bf16 chunks.
//
// Why: on CPUs without AMX a float32 chunk went to torch's flash kernel (attend_after_prefix: two
// flash calls and a log-sum-exp merge after a cached prefix), a third of a 1,000-token prompt's
// prefill on an AVX2-only Zen 3. Here each item (12 query rows of one head) runs three passes over
// a buffer of its scores (12 x 4 bytes a key, in L2): S = Q K^T in 6-row x 16-key register tiles
// (12 accumulators), then each row's maximum and probabilities in place over the keys it sees
// (paged_attention.h's exp_row, the decode kernel's softmax), then P V in 6-row x 16-dim register
// tiles, 64 keys a pass over every tile (so the pass's V rows stay in L1). The whole row is in the buffer, so there
// is no running maximum and no rescaling of the output. Measured (bench.probes.prefill_attention
// --dtype float32, 2 threads, Zen 3): 1.6-2.0x the torch path at a 1,000-token prompt's chunks,
// 1.03-1.2x at 4,000 and 8,000 keys, where both near the CPU's fp32 peak (~130 of 177 GFLOP/s).
//
// Layouts (per KV head, built once per call, zero-padded to whole blocks of 16 keys):
//   Kt: [16-key block][dim][16 keys]: one dim of 16 keys in two vectors (the B side of S = Q K^T);
//   V:  [key][dim] (the B side of P V: 16 dims of one key in two vectors).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"      // KVSERVE_X86, cpu_has_avx2
#include "prefill_attention.h"  // the contract, check_prefill_attention_args
#include "paged_attention.h"    // exp_row: the decode kernel's softmax

namespace {

#ifdef KVSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

constexpr int kRows = 12;   // query rows (positions of one head) per item
constexpr int kMicro = 6;   // rows per register tile: 12 accumulators of 8 lanes
constexpr int kBlock = 16;  // keys per S register tile (two vectors), and the packing's block
constexpr int kChunk = 64;  // keys per P V pass over the item's tiles (their V rows stay in L1)

// 8 values of `dtype` at src as fp32 (fp16 and bf16 widen exactly).
inline __m256 load8(const uint8_t* src, at::ScalarType dtype) {
  if (dtype == at::kFloat) return _mm256_loadu_ps(reinterpret_cast<const float*>(src));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if (dtype == at::kHalf) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Row r, head h of a [rows, heads, d] tensor (last dim contiguous) as d floats into dst.
inline void row_f32(const at::Tensor& t, int64_t r, int64_t h, int64_t d, float* dst) {
  const int64_t es = t.element_size();
  const auto* row = static_cast<const uint8_t*>(t.data_ptr()) + (r * t.stride(0) + h * t.stride(1)) * es;
  for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(dst + j, load8(row + j * es, t.scalar_type()));
}

// One KV head's keys (transposed per 16-key block) and values, as fp32 (see the file comment).
struct KVPanels {
  std::vector<float> kt, v;
  void build(const at::Tensor& keys, const at::Tensor& values, int64_t h, int64_t L, int64_t d) {
    const int64_t padded = (L + kBlock - 1) / kBlock * kBlock;
    kt.assign(padded * d, 0.f), v.assign(padded * d, 0.f);
    std::vector<float> row(d);
    for (int64_t key = 0; key < L; ++key) {
      row_f32(keys, key, h, d, row.data());
      float* block = kt.data() + key / kBlock * kBlock * d + key % kBlock;
      for (int64_t j = 0; j < d; ++j) block[j * kBlock] = row[j];
      row_f32(values, key, h, d, v.data() + key * d);
    }
  }
};

// s[r][16 b .. 16 b + 15] = q[r] . k for 4 rows (q: rows of d floats, stride d), one 16-key block.
inline void score_tile(const float* q, const float* kt, int64_t d, float* s, int64_t ld) {
  __m256 acc[kMicro][2];
  for (int r = 0; r < kMicro; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; ++j) {
    const __m256 k0 = _mm256_loadu_ps(kt + j * kBlock), k1 = _mm256_loadu_ps(kt + j * kBlock + 8);
    for (int r = 0; r < kMicro; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * d + j);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < kMicro; ++r) {
    _mm256_storeu_ps(s + r * ld, acc[r][0]);
    _mm256_storeu_ps(s + r * ld + 8, acc[r][1]);
  }
}

// acc[r] += sum over keys [k0, k1) of p[r][key] v[key][0..16) for kMicro rows (p stride ld, v stride d).
inline void value_tile(const float* p, int64_t ld, const float* v, int64_t d, int64_t k0, int64_t k1,
                       __m256 (&acc)[kMicro][2]) {
  for (int64_t key = k0; key < k1; ++key) {
    const __m256 v0 = _mm256_loadu_ps(v + key * d), v1 = _mm256_loadu_ps(v + key * d + 8);
    for (int r = 0; r < kMicro; ++r) {
      const __m256 x = _mm256_broadcast_ss(p + r * ld + key);
      acc[r][0] = _mm256_fmadd_ps(x, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, v1, acc[r][1]);
    }
  }
}

// Row r's scores s[0 .. ld) -> probabilities exp(s - max) for keys 0 .. pos (paged_attention.h's
// exp_row: the decode kernel's softmax, so decode and prefill rows exponentiate alike), zeros
// after; returns their sum. Key 0 is visible to every row, so the maximum is finite.
inline float softmax_row(float* s, int64_t ld, int64_t pos) {
  const float sum = kvserve::exp_row(s, pos + 1).second;
  std::fill(s + pos + 1, s + ld, 0.f);
  return sum;
}

// One item: query rows [i0, i0 + rows) of head qh (q: their rows, pre-scaled by scale,
// kRows x d, zeros past rows) at positions first = prefix + i0 .. over their keys, into out (row
// stride out_stride floats).
void attend_rows(const float* q, const KVPanels& kv, int64_t d, int64_t first, int64_t rows, float* out,
                 int64_t out_stride) {
  const int64_t last = first + rows - 1, blocks = last / kBlock + 1, ld = blocks * kBlock;
  const int64_t tiles = (rows + kMicro - 1) / kMicro;
  thread_local std::vector<float> buffer;
  buffer.resize(kRows * ld);
  float* s = buffer.data();
  for (int64_t b = 0; b < blocks; ++b)  // pass 1: S, a 16-key block (4 KB at d = 64, in L1) for every tile
    for (int64_t t = 0; t < tiles; ++t)
      score_tile(q + t * kMicro * d, kv.kt.data() + b * kBlock * d, d, s + t * kMicro * ld + b * kBlock, ld);
  float inv[kRows];
  for (int64_t r = 0; r < tiles * kMicro; ++r)  // pass 2: probabilities (padding rows as the last row)
    inv[r] = 1.f / softmax_row(s + r * ld, ld, std::min(first + r, last));
  // pass 3: O = P V / sum, kChunk keys at a time for every tile and 16 dims (the partial sums in o)
  alignas(32) float o[kRows * 256];
  for (int64_t k0 = 0; k0 <= last; k0 += kChunk)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t k1 = std::min({k0 + kChunk, first + (t + 1) * kMicro, last + 1});  // the tile's last row sees k1 - 1
      if (k1 <= k0) continue;
      for (int64_t d0 = 0; d0 < d; d0 += 16) {
        __m256 acc[kMicro][2];
        float* ot = o + t * kMicro * d + d0;
        for (int r = 0; r < kMicro; ++r)
          for (int c = 0; c < 2; ++c)
            acc[r][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(ot + r * d + 8 * c);
        value_tile(s + t * kMicro * ld, ld, kv.v.data() + d0, d, k0, k1, acc);
        for (int r = 0; r < kMicro; ++r)
          for (int c = 0; c < 2; ++c) _mm256_store_ps(ot + r * d + 8 * c, acc[r][c]);
      }
    }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 w = _mm256_set1_ps(inv[r]);
    for (int64_t j = 0; j < d; j += 8)
      _mm256_storeu_ps(out + r * out_stride + j, _mm256_mul_ps(_mm256_load_ps(o + r * d + j), w));
  }
}

at::Tensor prefill_attention_avx2(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  int64_t prefix, double scale) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = keys.size(1), L = prefix + n;
  const int64_t blocks = (n + kRows - 1) / kRows, group = heads / kv_heads, items = heads * blocks;
  std::vector<KVPanels> kv(kv_heads);
  at::Tensor out = at::empty({n, heads, d}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t h = 0; h < kv_heads; ++h) kv[h].build(keys, values, h, L, d);
    alignas(32) float qs[kRows * 256];  // an item's query rows, scaled (d <= 256)
    // KV head by KV head (a thread's next item reads the panels its last one left in its L2); within
    // a head the longest (last) row blocks first, so the dynamic deal ends evenly.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t h = i / (group * blocks), b = blocks - 1 - i / group % blocks, qh = h * group + i % group;
      const int64_t i0 = b * kRows, rows = std::min<int64_t>(kRows, n - i0);
      std::memset(qs, 0, sizeof(float) * kRows * d);
      for (int64_t r = 0; r < rows; ++r) {
        row_f32(q, i0 + r, qh, d, qs + r * d);
        for (int64_t j = 0; j < d; ++j) qs[r * d + j] *= static_cast<float>(scale);
      }
      attend_rows(qs, kv[h], d, prefix + i0, rows, op + (i0 * heads + qh) * d, heads * d);
    }
  }
  return out;
}

#pragma GCC pop_options
#endif  // KVSERVE_X86

bool supported() { return kvserve::cpu_has_avx2(); }

// prefill_attention.h's contract.
at::Tensor prefill_attention_f32(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 int64_t prefix, double scale) {
  TORCH_CHECK(supported(), "prefill_attention_f32 needs AVX2, FMA and F16C (prefill_attention_f32_supported)");
  kvserve::check_prefill_attention_args(q, keys, values, prefix, 16);
#ifdef KVSERVE_X86
  return prefill_attention_avx2(q, keys, values, prefix, scale);
#else
  return at::Tensor();
#endif
}

bool prefill_attention_f32_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("prefill_attention_f32(Tensor q, Tensor keys, Tensor values, int prefix, float scale) -> Tensor");
  m.def("prefill_attention_f32_supported() -> bool", &prefill_attention_f32_supported);
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("prefill_attention_f32", &prefill_attention_f32); }
