// A prefill chunk's attention on AMX-BF16 tiles (Sapphire Rapids and later Xeons): the n new
// tokens' queries, at positions prefix .. prefix + n - 1, over the chunk's L = prefix + n keys
// (the cached prefix all visible, the chunk's own keys causally), grouped query heads, one call
// per chunk. q, k and v are rounded to bf16 (as torch's `.to(torch.bfloat16)` rounds them: to
// nearest, ties to even); the scores, the softmax and its sums are fp32; the probabilities are
// rounded to bf16 for the P V product, as torch's CPU flash kernel does on bf16 inputs; the
// output is fp32 [n, heads, head_dim]. attend_rows_on_tiles (prefill_attention.h) runs the same
// build and row tiles for the native decode stack (decode_layer.cpp): a chunk's rows over a paged
// pool's rows of one kv head, through the block table, on one thread.
//
// Why: torch's flash kernel on the same bf16 inputs took 5.8 ms a layer for a 1,000-token
// prompt's two chunks (9 heads of 64 over 3 KV heads, 2 threads), ~1/3 of the prefill; its
// products run on the tiles but the rest (per-block packing, conversions, a second call and a
// log-sum-exp merge for a cached prefix) does not. Here each (query head, 16 query rows) takes
// 64 keys a step in two passes (attend_tile): S = Q K^T in 4 fp32 tiles and each row's maximum,
// then the probabilities in 512-bit vectors (exp2 by scalef) and P V accumulated in up to 4 tiles
// of 16 output dimensions. Measured (bench.probes.prefill_attention, 2 threads): 1.9-3x faster
// than the torch path at a 1,000-token prompt's chunks, 1.4-2x at 4,000 and 8,000 keys.
// What bounds it: the AMX products take ~8 ns each (16 a step) and the softmax ~1,000 vector
// instructions a step, and the two overlap little.

// Layouts (per KV head, built once per call, zero-padded to whole steps of 64 keys):
//   K (B tiles of S = Q K^T): [16-key block][32-dim chunk][dim pair p][key][2]: row p of a tile
//     holds dims 2p, 2p + 1 of 16 keys.
//   V (B tiles of P V): [32-key block][16-dim slice][key pair p][dim][2].
// Queries are read in place from a bf16 copy [rows, heads, head_dim] (A tiles: 16 rows x 32 dims).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"          // KVSERVE_AMX (the compiler has the AMX intrinsics), configure_full_tiles
#include "cpu_features.h"       // cpu_has_amx
#include "prefill_attention.h"  // the contract, check_prefill_attention_args

#ifdef KVSERVE_AMX
#include <cpuid.h>
#endif

namespace {

#ifdef KVSERVE_AMX
// AMX-BF16 and AVX512-BF16 besides what cpu_has_amx asks (AMX tiles, the OS's permission,
// KVSERVE_NO_AMX unset). Asked at first use, not at load: cpu_has_amx's answer is another
// source's static constant.
bool detect_amx_bf16() {
  if (!kvserve::cpu_has_amx()) return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1)) return false;  // AMX-BF16
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1);                 // AVX512-BF16
}
#endif

}  // namespace

bool kvserve::cpu_has_amx_bf16() {
#ifdef KVSERVE_AMX
  static const bool yes = detect_amx_bf16();
  return yes;
#else
  return false;
#endif
}

namespace {

bool supported() { return kvserve::cpu_has_amx_bf16(); }

#ifdef KVSERVE_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

constexpr int kRows = 16;   // query rows per tile
constexpr int kStep = 64;   // keys per step: four 16-key S tiles

// 2^x for x <= 0 (up to rounding) in every lane, x >= -126 after the clamp (no denormals):
// x = n + f, |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n by
// scalef.
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284770e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 values of a row of `dtype` at src as bf16 (round to nearest, ties to even: as torch).
inline __m256i bf16_16(const void* src, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return _mm256_loadu_si256(static_cast<const __m256i*>(src));
  const __m512 f = dtype == at::kHalf ? _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(src)))
                                      : _mm512_loadu_ps(static_cast<const float*>(src));
  return (__m256i)_mm512_cvtneps_pbh(f);
}

// d values (a multiple of 16) of `dtype` at src as bf16 at dst.
inline void row_to_bf16(const void* src, at::ScalarType dtype, int64_t d, uint16_t* dst) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t j = 0; j < d; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), bf16_16(static_cast<const uint8_t*>(src) + j * es, dtype));
}

// rows [r0, r1) of a [rows, heads, d] / [L, kv_heads, d] tensor (last dim contiguous), head h, as
// bf16 rows of d into dst (row stride ld elements).
void to_bf16_rows(const at::Tensor& t, int64_t h, int64_t r0, int64_t r1, uint16_t* dst, int64_t ld) {
  const int64_t es = t.element_size();
  const auto* base = static_cast<const uint8_t*>(t.data_ptr()) + h * t.stride(1) * es;
  for (int64_t r = r0; r < r1; ++r) row_to_bf16(base + r * t.stride(0) * es, t.scalar_type(), t.size(2), dst + (r - r0) * ld);
}

// One KV head's keys and values re-laid for the tiles (see the file comment), built a step of 64
// keys at a time (build_step, any thread); keys past L are zeros.
struct KVTiles {
  std::vector<uint16_t> k, v;  // bf16 bits
  void allocate(int64_t L, int64_t d) {
    const int64_t padded = (L + kStep - 1) / kStep * kStep;
    k.resize(padded / 16 * (d / 32) * 512), v.resize(padded / 32 * (d / 16) * 512);
  }
  // rows(values, r0, r1, dst): rows [r0, r1) of the keys (values: of the values) as bf16 rows of d at dst
  template <typename Rows>
  void build_step(const Rows& rows_of, int64_t t, int64_t L, int64_t d) {
    alignas(64) uint16_t stage[kStep * 256];  // the step's 64 rows as bf16 (d <= 256)
    const int64_t k0 = t * kStep, rows = std::min<int64_t>(kStep, L - k0);
    std::memset(stage + rows * d, 0, (kStep - rows) * d * 2);
    rows_of(false, k0, k0 + rows, stage);
    // K: row p of block b's chunk c = dword c * 16 + p (dims 2p, 2p + 1) of keys 16 b .. 16 b + 15
    const __m512i by_key = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(d / 2)));
    for (int64_t b = 0; b < kStep / 16; ++b)
      for (int64_t c = 0; c < d / 32; ++c)
        for (int p = 0; p < 16; ++p) {
          const auto* src = reinterpret_cast<const int*>(stage + b * 16 * d + c * 32 + 2 * p);
          _mm512_storeu_si512(k.data() + (((4 * t + b) * (d / 32) + c) * 16 + p) * 32,
                              _mm512_i32gather_epi32(by_key, src, 4));
        }
    rows_of(true, k0, k0 + rows, stage);
    // V: row p of block b's slice s = keys 32 b + 2p, 32 b + 2p + 1 interleaved over dims 16 s ..
    alignas(64) int16_t order[32];
    for (int j = 0; j < 16; ++j) order[2 * j] = static_cast<int16_t>(j), order[2 * j + 1] = static_cast<int16_t>(32 + j);
    const __m512i interleave = _mm512_load_si512(order);
    for (int64_t b = 0; b < kStep / 32; ++b)
      for (int64_t s = 0; s < d / 16; ++s)
        for (int p = 0; p < 16; ++p) {
          const uint16_t* even = stage + (b * 32 + 2 * p) * d + s * 16;
          const __m512i lo = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)));
          const __m512i hi = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d)));
          _mm512_storeu_si512(v.data() + (((2 * t + b) * (d / 16) + s) * 16 + p) * 32,
                              _mm512_permutex2var_epi16(lo, interleave, hi));
        }
  }
  const uint16_t* k_tile(int64_t block16, int64_t chunk, int64_t d) const { return k.data() + (block16 * (d / 32) + chunk) * 512; }
  const uint16_t* v_tile(int64_t block32, int64_t slice, int64_t d) const { return v.data() + (block32 * (d / 16) + slice) * 512; }
};

// S = Q K^T of one row tile (16 query rows of one head, bf16 at q, row stride q_stride bytes) for
// keys 64 t .. 64 t + 63 into s (row stride ld floats), in tiles 0-3 (before the output takes
// them), the K tiles through 4, 5 and 7 in turn: a tile load waits for the products still reading
// its tile, so one B tile for all four had serialized them.
inline void scores(const uint16_t* q, int64_t q_stride, const KVTiles& kv, int64_t t, int64_t d, float* s, int64_t ld) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t c = 0; c < d / 32; ++c) {
    _tile_loadd(6, q + c * 32, q_stride);
    _tile_loadd(4, kv.k_tile(4 * t, c, d), 64); _tile_dpbf16ps(0, 6, 4);
    _tile_loadd(5, kv.k_tile(4 * t + 1, c, d), 64); _tile_dpbf16ps(1, 6, 5);
    _tile_loadd(7, kv.k_tile(4 * t + 2, c, d), 64); _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(4, kv.k_tile(4 * t + 3, c, d), 64); _tile_dpbf16ps(3, 6, 4);
  }
  _tile_stored(0, s, ld * 4); _tile_stored(1, s + 16, ld * 4);
  _tile_stored(2, s + 32, ld * 4); _tile_stored(3, s + 48, ld * 4);
}

// O += P V for keys 64 t .. 64 t + 63 (P: bf16 [kRows, kStep], in tiles 4 and 5) over output dims
// d0 .. d0 + 16 nd (nd = 2 or 4 slices), O in tiles 0 .. nd - 1, the V tiles through 6 and 7. Every
// O tile's first product comes before any second one: a product waits for the one before it on
// the same tile to finish, which back to back had serialized them.
inline void add_values(const uint16_t* p, const KVTiles& kv, int64_t t, int64_t d, int64_t d0, int64_t nd) {
  const int64_t s0 = d0 / 16, b = 2 * t;
  _tile_loadd(4, p, kStep * 2); _tile_loadd(5, p + 32, kStep * 2);
  _tile_loadd(6, kv.v_tile(b, s0, d), 64); _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, kv.v_tile(b, s0 + 1, d), 64); _tile_dpbf16ps(1, 4, 7);
  if (nd == 4) {
    _tile_loadd(6, kv.v_tile(b, s0 + 2, d), 64); _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, kv.v_tile(b, s0 + 3, d), 64); _tile_dpbf16ps(3, 4, 7);
  }
  _tile_loadd(6, kv.v_tile(b + 1, s0, d), 64); _tile_dpbf16ps(0, 5, 6);
  _tile_loadd(7, kv.v_tile(b + 1, s0 + 1, d), 64); _tile_dpbf16ps(1, 5, 7);
  if (nd == 4) {
    _tile_loadd(6, kv.v_tile(b + 1, s0 + 2, d), 64); _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, kv.v_tile(b + 1, s0 + 3, d), 64); _tile_dpbf16ps(3, 5, 7);
  }
}

inline void store_output(float* o, int64_t nd) {
  _tile_stored(0, o, 256); _tile_stored(1, o + 16, 256);
  if (nd == 4) { _tile_stored(2, o + 32, 256); _tile_stored(3, o + 48, 256); }
}

// Keys past each row's position in step t (keys 64 t ..) set to -inf in y [4][16]; keep: the rest.
// Rows past `rows` (a tile's padding) take the last row's position.
inline void mask_step(__m512* y, __mmask16* keep, int r, int64_t rows, int64_t first, int64_t k0) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i limit = _mm512_set1_epi32(static_cast<int>((r < rows ? first + r : first + rows - 1) - k0));
  for (int j = 0; j < 4; ++j) {
    keep[j] = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * j)), limit);
    y[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep[j], y[j]);
  }
}

// One row tile: query rows [i0, i0 + rows) of one head (bf16 at q, row stride q_stride bytes) at
// positions first = prefix + i0 .. over their keys, output dims d0 .. d0 + 16 nd into out (row
// stride out_stride floats). Two passes: the first multiplies S = Q K^T for every key into a
// buffer (16 x 4 bytes a key: 256 KB at 4,000 keys, in L2) and finds each row's maximum; the
// second takes the probabilities exp2(scale log2(e) (s - max)), whose largest is then exactly 1
// in bf16, and accumulates P V in tiles 0-3 across the steps. So there is no running maximum to
// rescale the output and the sums by (an online softmax that rescaled only when its maximum grew
// by 2^8 had doubled the error against a float64 reference; one that rescaled at every growth
// stored and reloaded the output tiles at most steps). Each pass lags its vector work one step
// behind its tile work, so a tile load never reads vector stores just made, nor a vector load
// tile stores. Tiles, pass 1: 0-3 S (16 rows x 16 keys, fp32), 6 a Q chunk (A: 16 rows x 32
// dims), 4, 5, 7 K (B); pass 2: 0-3 the output (16 rows x 16 dims, fp32), 4, 5 P (A: keys 0-31,
// 32-63), 6, 7 V (B).
void attend_tile(const uint16_t* q, int64_t q_stride, const KVTiles& kv, int64_t d, int64_t d0, int64_t nd,
                 int64_t first, int64_t rows, float scale_log2e, float* out, int64_t out_stride) {
  alignas(64) uint16_t p[2][kRows * kStep];
  alignas(64) float o[kRows * 64];
  alignas(64) float l[kRows][16];    // each row's sum of probabilities, lane by lane
  alignas(64) float top[kRows][16];  // each row's largest score, lane by lane
  const int64_t steps = (first + rows - 1 + kStep) / kStep;  // keys 0 .. the last row's position
  const int64_t unmasked = (first + 1) / kStep;  // steps whose keys every row sees
  const int64_t ld = steps * kStep;
  thread_local std::vector<float> buffer;
  buffer.resize(kRows * ld + 16);  // + 16: 64-byte alignment
  float* s = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;
  const __m512 c = _mm512_set1_ps(scale_log2e);
  for (int r = 0; r < kRows; ++r) _mm512_store_ps(top[r], _mm512_set1_ps(-INFINITY));
  std::memset(l, 0, sizeof(l));
  for (int64_t t = 0; t <= steps; ++t) {  // pass 1: S and the maxima
    if (t < steps) scores(q, q_stride, kv, t, d, s + t * kStep, ld);
    if (t == 0) continue;
    const int64_t u = t - 1;
    for (int r = 0; r < kRows; ++r) {
      __m512 y[4];
      __mmask16 keep[4];
      for (int j = 0; j < 4; ++j) y[j] = _mm512_load_ps(s + r * ld + u * kStep + 16 * j);
      if (u >= unmasked) mask_step(y, keep, r, rows, first, u * kStep);
      _mm512_store_ps(top[r], _mm512_max_ps(_mm512_load_ps(top[r]),
                                            _mm512_max_ps(_mm512_max_ps(y[0], y[1]), _mm512_max_ps(y[2], y[3]))));
    }
  }
  float m[kRows];  // finite: key 0 is visible to every row
  for (int r = 0; r < kRows; ++r) m[r] = _mm512_reduce_max_ps(_mm512_load_ps(top[r])) * scale_log2e;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t t = 0; t <= steps; ++t) {  // pass 2: P, and the step before's P V
    if (t < steps) {
      uint16_t* pt = p[t & 1];
      for (int r = 0; r < kRows; ++r) {
        __m512 y[4];
        __mmask16 keep[4] = {0xffff, 0xffff, 0xffff, 0xffff};
        for (int j = 0; j < 4; ++j) y[j] = _mm512_load_ps(s + r * ld + t * kStep + 16 * j);
        if (t >= unmasked) mask_step(y, keep, r, rows, first, t * kStep);
        const __m512 mv = _mm512_set1_ps(m[r]);
        __m512 sum = _mm512_load_ps(l[r]);
        for (int j = 0; j < 4; ++j) {
          y[j] = exp2_nonpositive(_mm512_fmsub_ps(y[j], c, mv));
          if (t >= unmasked) y[j] = _mm512_maskz_mov_ps(keep[j], y[j]);
          sum = _mm512_add_ps(sum, y[j]);
        }
        _mm512_store_ps(l[r], sum);
        _mm512_store_si512(pt + r * kStep, (__m512i)_mm512_cvtne2ps_pbh(y[1], y[0]));
        _mm512_store_si512(pt + r * kStep + 32, (__m512i)_mm512_cvtne2ps_pbh(y[3], y[2]));
      }
    }
    if (t > 0) add_values(p[(t - 1) & 1], kv, t - 1, d, d0, nd);
  }
  store_output(o, nd);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(l[r])));
    for (int64_t j = 0; j < nd; ++j)
      _mm512_storeu_ps(out + r * out_stride + 16 * j, _mm512_mul_ps(_mm512_load_ps(o + r * 64 + 16 * j), inv));
  }
}

at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 int64_t prefix, double scale) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = keys.size(1), L = prefix + n;
  const int64_t blocks = (n + kRows - 1) / kRows, steps = (L + kStep - 1) / kStep;
  std::vector<uint16_t> qb(blocks * kRows * heads * d);  // q as bf16, zeros up to whole tiles of rows
  std::vector<KVTiles> kv(kv_heads);
  for (auto& tiles : kv) tiles.allocate(L, d);
  at::Tensor out = at::empty({n, heads, d}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads, items = heads * blocks;
  const float scale_log2e = static_cast<float>(scale * 1.4426950408889634);
  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < heads; ++h) to_bf16_rows(q, h, r, r + 1, qb.data() + (r * heads + h) * d, d);
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < kv_heads * steps; ++i) {
      const int64_t h = i / steps;
      kv[h].build_step([&](bool v, int64_t r0, int64_t r1, uint16_t* dst) { to_bf16_rows(v ? values : keys, h, r0, r1, dst, d); },
                       i % steps, L, d);
    }
    kvserve::configure_full_tiles();  // every tile 16 rows x 64 bytes (attend_tile's map)
    // KV head by KV head, so that a thread's next item reads the K and V tiles its last one left
    // in its L2 (at 4,000 keys one head's are 1 MB); within a head the longest (last) query blocks
    // first, so the dynamic deal ends evenly. An item: one row tile, every 64 output dims.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t h = i / (group * blocks), b = blocks - 1 - i / group % blocks, qh = h * group + i % group;
      const int64_t i0 = b * kRows, rows = std::min<int64_t>(kRows, n - i0);
      for (int64_t d0 = 0; d0 < d; d0 += 64)
        attend_tile(qb.data() + (i0 * heads + qh) * d, heads * d * 2, kv[h], d, d0, std::min<int64_t>(64, d - d0) / 16,
                    prefix + i0, rows, scale_log2e, op + (i0 * heads + qh) * d + d0, heads * d);
    }
    _tile_release();
  }
  return out;
}

// prefill_attention.h's attend_rows_on_tiles: the same build and row tiles as prefill_attention_amx,
// over the pool's rows of one kv head, on the calling thread.
template <typename T>
void attend_rows_amx(const float* q, int64_t q_ld, int64_t G, int64_t d, const kvserve::PagedRows<T>& kv_rows,
                     int64_t prefix, int64_t n, float scale, float* out, int64_t out_ld) {
  const int64_t L = prefix + n, blocks = (n + kRows - 1) / kRows, steps = (L + kStep - 1) / kStep;
  const at::ScalarType dtype = std::is_same<T, float>::value ? at::kFloat : at::kHalf;
  thread_local KVTiles kv;
  thread_local std::vector<uint16_t> qb;
  kv.allocate(L, d);
  qb.assign(blocks * kRows * G * d, 0);  // [rows, G, d] as bf16, zeros up to whole tiles of rows
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < G; ++h) row_to_bf16(q + i * q_ld + h * d, at::kFloat, d, qb.data() + (i * G + h) * d);
  const auto rows_of = [&](bool values, int64_t r0, int64_t r1, uint16_t* dst) {
    for (int64_t r = r0; r < r1; ++r) row_to_bf16(kv_rows.row(values, r), dtype, d, dst + (r - r0) * d);
  };
  for (int64_t t = 0; t < steps; ++t) kv.build_step(rows_of, t, L, d);
  const float scale_log2e = static_cast<float>(scale * 1.4426950408889634);
  kvserve::configure_full_tiles();
  for (int64_t h = 0; h < G; ++h)
    for (int64_t b = blocks - 1; b >= 0; --b) {
      const int64_t i0 = b * kRows, rows = std::min<int64_t>(kRows, n - i0);
      for (int64_t d0 = 0; d0 < d; d0 += 64)
        attend_tile(qb.data() + (i0 * G + h) * d, G * d * 2, kv, d, d0, std::min<int64_t>(64, d - d0) / 16, prefix + i0,
                    rows, scale_log2e, out + i0 * out_ld + h * d + d0, out_ld);
    }
  _tile_release();
}

#pragma GCC pop_options
#endif  // KVSERVE_AMX

// prefill_attention.h's contract.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t prefix,
                             double scale) {
  TORCH_CHECK(supported(), "prefill_attention needs AMX-BF16 and AVX512-BF16 (prefill_attention_supported)");
  kvserve::check_prefill_attention_args(q, keys, values, prefix, 32);
#ifdef KVSERVE_AMX
  return prefill_attention_amx(q, keys, values, prefix, scale);
#else
  return at::Tensor();
#endif
}

bool prefill_attention_supported() { return supported(); }

}  // namespace

bool kvserve::rows_on_tiles_supported(int64_t d) { return supported() && d % 32 == 0 && d <= 256; }

template <typename T>
void kvserve::attend_rows_on_tiles(const float* q, int64_t q_ld, int64_t G, int64_t d, const PagedRows<T>& kv_rows,
                                   int64_t prefix, int64_t n, float scale, float* out, int64_t out_ld) {
  TORCH_CHECK(rows_on_tiles_supported(d), "attend_rows_on_tiles needs AMX-BF16 and a head size that is a multiple of 32");
#ifdef KVSERVE_AMX
  attend_rows_amx(q, q_ld, G, d, kv_rows, prefix, n, scale, out, out_ld);
#else
  (void)q, (void)q_ld, (void)G, (void)kv_rows, (void)prefix, (void)n, (void)scale, (void)out, (void)out_ld;
#endif
}
template void kvserve::attend_rows_on_tiles<float>(const float*, int64_t, int64_t, int64_t, const PagedRows<float>&,
                                                   int64_t, int64_t, float, float*, int64_t);
template void kvserve::attend_rows_on_tiles<c10::Half>(const float*, int64_t, int64_t, int64_t,
                                                       const PagedRows<c10::Half>&, int64_t, int64_t, float, float*,
                                                       int64_t);

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("prefill_attention(Tensor q, Tensor keys, Tensor values, int prefix, float scale) -> Tensor");
  m.def("prefill_attention_supported() -> bool", &prefill_attention_supported);
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
