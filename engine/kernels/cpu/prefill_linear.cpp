// A prefill chunk's block matmuls on AMX-BF16 tiles (Sapphire Rapids and later Xeons): y[M, N] =
// x[M, K] @ W^T with W packed GGUF blocks (any format gguf_linear takes), and the fused
// SiLU(gate) * up of a gate/up matrix; gguf_linear_bf16_out writes y into a column slice of a wider
// output. x and the weights are rounded to bf16 (to nearest, ties to
// even, as torch's `.to(torch.bfloat16)`); the products and their sums are fp32 (TDPBF16PS); the
// output is fp32. No dense copy of W is kept: each thread decodes a panel of output features at a
// time (gguf_decode_range, exact fp32, then bf16) into a buffer that stays in its L2.
//
// Why: the int8 kernels (quant_linear_q8.cpp, quant_linear_amx.cpp) apply their per-32 or per-256
// scales in fp32 after each block's integer product, and that float work bounds them at 512 rows to
// ~120-190 GMAC/s a thread on this project's Sapphire Rapids VM; bf16 tiles take the scales inside
// the decoded weights, so a panel's products run back to back (oneDNN's bf16 GEMM, on dense bf16
// weights, measured ~1,000 GMAC/s on 2 threads here). The decode is once per call and output
// feature, so it pays from a few hundred rows at most (BlockLinear.BF16_MIN_ROWS).
//
// Layouts: the tiles multiply C[16 features][16 rows] += A[16 features][32 k] B[16 k pairs][16
// rows][2]. A is the panel itself: bf16 rows of the features, [features][kc] (row stride
// panel_stride(kc)). B is x once per call, bf16, as [row tile][32-k chunk][k pair p][row][2] (1 KB a
// tile, rows past M zero).
// C tiles accumulate over a K block in the thread's acc buffer [group][row tile][16][16] and are
// transposed into y's rows at the end; the swiglu form multiplies SiLU(gate tile) * up tile first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"      // KVSERVE_AMX, configure_full_tiles
#include "cpu_features.h"   // cpu_has_amx_bf16
#include "quant_linear.h"   // gguf_decode_range
#include "vec_math.h"       // silu_mul

namespace {

bool supported() { return kvserve::cpu_has_amx_bf16(); }

#ifdef KVSERVE_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

constexpr int64_t kTile = 16;        // rows per tile, features per group
constexpr int64_t kChunk = 32;       // k per tile product
constexpr int64_t kKBlock = 1024;    // k per accumulation block (a row tile pair's B tiles: 64 KB)
constexpr int64_t kPanelBytes = 256 << 10;  // bf16 bytes of a thread's decoded panel

// The panel's row stride, in bf16: one cache line past kc, so that a tile's 16 rows (and the next
// group's) do not share the few L1 sets a stride of 2 KB (kc = 1,024) maps them to. With it and the
// prefetches in multiply, the 1B Q4_K_M's gate/up took ~0.88x the time (alternated in one process).
inline int64_t panel_stride(int64_t kc) { return kc + 32; }

// r[0..15] (16 rows of 16 dwords) transposed in place.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4g + j]'s 128-bit lane L: rows 4g .. 4g + 3 at column 4L + j
  for (int j = 0; j < 4; ++j) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    const __m512i v0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), v1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
    t[j] = _mm512_shuffle_i32x4(u0, v0, 0x88), t[8 + j] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    t[4 + j] = _mm512_shuffle_i32x4(u1, v1, 0x88), t[12 + j] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 32 fp32 at src as 32 bf16 in order (one dword a pair of k).
inline __m512i bf16_32(const float* src) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
}

// x [M, K] -> B tiles [T][K / 32][16 pairs][16 rows][2] bf16 (rows past M zero), tile t's rows.
void build_b_tiles(const float* x, int64_t M, int64_t K, int64_t t, uint16_t* xb) {
  const int64_t chunks = K / kChunk;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t row = t * kTile + i;
      r[i] = row < M ? bf16_32(x + row * K + c * kChunk) : _mm512_setzero_si512();
    }
    transpose16(r);
    uint16_t* dst = xb + (t * chunks + c) * 512;
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 32, r[p]);
  }
}

// The call's shape and its buffers, shared by the threads.
struct Problem {
  const float* x;
  const uint8_t* w;
  int64_t M, K, N, format;
  int64_t half;           // swiglu: the gate/up split (features [0, half) gate, [half, N) up); 0: plain
  const uint16_t* xb;     // B tiles
  float* out;             // [M, ldo]
  int64_t ldo;
};

// One thread's scratch, reused across its panels.
struct Scratch {
  std::vector<float> rows;      // [features][kc] fp32 decoded
  std::vector<uint16_t> panel;  // [features][panel_stride(kc)] bf16
  std::vector<float> acc;       // [groups][row tiles][16][16]
};

// Decode the panel's groups (group g: the 16 matrix rows from first[g], those past the gate's or
// the matrix's end as zeros) at k [k0, k0 + kc) into s.panel as bf16 rows.
void decode_panel(const Problem& p, const std::vector<int64_t>& first, int64_t k0, int64_t kc, Scratch& s) {
  const int64_t features = static_cast<int64_t>(first.size()) * kTile;
  const int64_t ld = panel_stride(kc);
  s.rows.resize(features * kc);
  s.panel.resize(features * ld);
  for (size_t g = 0; g < first.size(); ++g) {
    float* dst = s.rows.data() + g * kTile * kc;
    const int64_t n0 = first[g], limit = p.half && n0 < p.half ? p.half : p.N;
    const int64_t valid = std::max<int64_t>(0, std::min(kTile, limit - n0));
    if (valid > 0) kvserve::gguf_decode_range(p.w, p.K, p.format, n0, n0 + valid, k0, k0 + kc, dst, kc);
    std::memset(dst + valid * kc, 0, (kTile - valid) * kc * sizeof(float));
  }
  for (int64_t f = 0; f < features; ++f)
    for (int64_t k = 0; k < kc; k += 32)
      _mm512_storeu_si512(s.panel.data() + f * ld + k, bf16_32(s.rows.data() + f * kc + k));
}

// C tiles for groups (g0, g0 + 1) x row tiles (t0, t0 + 1 if two_rows) over k chunks [0, kc / 32) of
// the panel and the B tiles from chunk c0; acc holds them (loaded first unless `fresh`).
inline void multiply(const Scratch& s, const uint16_t* xb, int64_t chunks_total, int64_t kc, int64_t c0, int64_t g0,
                     int64_t t0, bool two_rows, int64_t tiles, float* acc, bool fresh) {
  float* c00 = acc + (g0 * tiles + t0) * 256;
  float* c01 = c00 + 256;
  float* c10 = acc + ((g0 + 1) * tiles + t0) * 256;
  float* c11 = c10 + 256;
  if (fresh) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  } else {
    _tile_loadd(0, c00, 64); _tile_loadd(2, c10, 64);
    if (two_rows) { _tile_loadd(1, c01, 64); _tile_loadd(3, c11, 64); }
  }
  const int64_t ld = panel_stride(kc);
  const uint16_t* a0 = s.panel.data() + g0 * kTile * ld;
  const uint16_t* a1 = a0 + kTile * ld;
  const uint16_t* b0 = xb + (t0 * chunks_total + c0) * 512;
  const uint16_t* b1 = b0 + chunks_total * 512;
  // A tile load waits for the products still reading the tile it replaces, so each tile's last
  // reader is two products before its next load: A4 (products 0, 1), B6 (0, 2), B7 (1, 3), A5 (2, 3).
  for (int64_t c = 0; c < kc / kChunk; ++c) {
    if (c + 1 < kc / kChunk)  // the next chunk's tiles into L1: a tile load waits on every line it misses
      for (int i = 0; i < kTile; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(a0 + i * ld + (c + 1) * kChunk), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a1 + i * ld + (c + 1) * kChunk), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b0 + (c + 1) * 512 + i * 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b1 + (c + 1) * 512 + i * 32), _MM_HINT_T0);
      }
    _tile_loadd(4, a0 + c * kChunk, ld * 2);
    _tile_loadd(6, b0 + c * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_rows) {
      _tile_loadd(7, b1 + c * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_loadd(5, a1 + c * kChunk, ld * 2);
    _tile_dpbf16ps(2, 5, 6);
    if (two_rows) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c00, 64); _tile_stored(2, c10, 64);
  if (two_rows) { _tile_stored(1, c01, 64); _tile_stored(3, c11, 64); }
}

// acc tile (16 features x 16 rows) transposed into out rows [r0, r0 + rows), columns [n, n + cols).
inline void store_tile(const float* tile, float* out, int64_t ldo, int64_t r0, int64_t rows, int64_t n, int64_t cols) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(tile + i * 16);
  transpose16(r);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t i = 0; i < rows; ++i) _mm512_mask_storeu_ps(out + (r0 + i) * ldo + n, keep, _mm512_castsi512_ps(r[i]));
}

// One panel: output features [n0, n0 + 16 G) (plain) or gate [n0, ..) with up [half + n0, ..)
// (swiglu: G / 2 groups of each), every row.
void run_panel(const Problem& p, int64_t n0, int64_t groups, Scratch& s) {
  std::vector<int64_t> first(groups);
  const int64_t out_groups = p.half ? groups / 2 : groups;
  for (int64_t g = 0; g < groups; ++g)
    first[g] = p.half ? (g < out_groups ? n0 + g * kTile : p.half + n0 + (g - out_groups) * kTile) : n0 + g * kTile;
  const int64_t tiles = (p.M + kTile - 1) / kTile, chunks_total = p.K / kChunk;
  s.acc.resize(groups * tiles * 256);
  for (int64_t k0 = 0; k0 < p.K; k0 += kKBlock) {
    const int64_t kc = std::min(kKBlock, p.K - k0);
    decode_panel(p, first, k0, kc, s);
    // a row tile pair's B tiles (32 rows x kc) serve every group of the panel before the next pair
    for (int64_t t = 0; t < tiles; t += 2)
      for (int64_t g = 0; g < groups; g += 2)
        multiply(s, p.xb, chunks_total, kc, k0 / kChunk, g, t, t + 1 < tiles, tiles, s.acc.data(), k0 == 0);
  }
  alignas(64) float act[256];
  for (int64_t g = 0; g < out_groups; ++g) {
    const int64_t n = n0 + g * kTile, limit = p.half ? p.half : p.N, cols = std::min(kTile, limit - n);
    if (cols <= 0) break;
    for (int64_t t = 0; t < tiles; ++t) {
      const float* tile = s.acc.data() + (g * tiles + t) * 256;
      if (p.half) {
        kvserve::silu_mul(tile, s.acc.data() + ((g + out_groups) * tiles + t) * 256, 256, act);
        tile = act;
      }
      store_tile(tile, p.out, p.ldo, t * kTile, std::min(kTile, p.M - t * kTile), n, cols);
    }
  }
}

void run(Problem& p, int64_t out_features) {
  const int64_t tiles = (p.M + kTile - 1) / kTile;
  std::vector<uint16_t> xb(tiles * p.K * kTile);
  p.xb = xb.data();
  // panels: a multiple of 32 features (whole group pairs; swiglu: 16 gate + 16 up a pair), sized to
  // kPanelBytes of bf16 over a K block, and at least 4 a thread so the dynamic deal ends evenly
  const int threads = std::max(1, at::get_num_threads());
  const int64_t pair_features = p.half ? kTile : 2 * kTile;  // output features a group pair gives
  const int64_t pairs = (out_features + pair_features - 1) / pair_features;
  const int64_t by_size = std::max<int64_t>(1, kPanelBytes / (2 * kTile * 2 * std::min(kKBlock, p.K)));
  const int64_t per_panel = std::max<int64_t>(1, std::min(by_size, pairs / (4 * threads)));
  const int64_t panels = (pairs + per_panel - 1) / per_panel;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) build_b_tiles(p.x, p.M, p.K, t, xb.data());
    kvserve::configure_full_tiles();
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < panels; ++i) {
      const int64_t pair0 = i * per_panel, count = std::min(per_panel, pairs - pair0);
      run_panel(p, pair0 * pair_features, 2 * count, s);
    }
    _tile_release();
  }
}

#pragma GCC pop_options
#endif  // KVSERVE_AMX

void check(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format) {
  TORCH_CHECK(supported(), "gguf_linear_bf16 needs AMX-BF16 and AVX512-BF16 (gguf_linear_bf16_supported)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a 2-D float32 CPU tensor");
  kvserve::gguf_check_packed(packed, N, x.size(1), format);
}

// x [M, K] fp32, packed [N, K] matrix -> [M, N] fp32.
at::Tensor gguf_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format) {
  check(x, packed, N, format);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor out = at::empty({M, N}, xc.options());
#ifdef KVSERVE_AMX
  if (M == 0) return out;
  Problem p{xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), M, K, N, format, 0, nullptr, out.data_ptr<float>(), N};
  run(p, N);
#endif
  return out;
}

// The same into out [M, N] with unit column stride, any row stride: a column slice of a wider
// output, so that a matrix stored in parts (q / k in one format, v in another) fills one tensor.
void gguf_linear_bf16_out(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format, at::Tensor& out) {
  check(x, packed, N, format);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.device().is_cpu() && out.size(0) == M &&
              out.size(1) == N && out.stride(1) == 1 && out.stride(0) >= N,
              "out must be a [", M, ", ", N, "] float32 CPU tensor with unit column stride");
#ifdef KVSERVE_AMX
  if (M == 0) return;
  Problem p{xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), M, K, N, format, 0, nullptr, out.data_ptr<float>(),
            out.stride(0)};
  run(p, N);
#endif
}

// SiLU(x @ gate^T) * (x @ up^T) for a gate/up matrix of 2 half features (gate's first) -> [M, half].
at::Tensor gguf_swiglu_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t half, int64_t format) {
  TORCH_CHECK(half > 0 && half % 8 == 0, "half must be a positive multiple of 8");
  check(x, packed, 2 * half, format);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor out = at::empty({M, half}, xc.options());
#ifdef KVSERVE_AMX
  if (M == 0) return out;
  Problem p{xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), M, K, 2 * half, format, half, nullptr,
            out.data_ptr<float>(), half};
  run(p, half);
#endif
  return out;
}

bool gguf_linear_bf16_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_linear_bf16(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
  m.def("gguf_linear_bf16_out(Tensor x, Tensor packed, int out_features, int format, Tensor(a!) out) -> ()");
  m.def("gguf_swiglu_bf16(Tensor x, Tensor packed, int half, int format) -> Tensor");
  m.def("gguf_linear_bf16_supported() -> bool", &gguf_linear_bf16_supported);
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_linear_bf16", &gguf_linear_bf16);
  m.impl("gguf_linear_bf16_out", &gguf_linear_bf16_out);
  m.impl("gguf_swiglu_bf16", &gguf_swiglu_bf16);
}
