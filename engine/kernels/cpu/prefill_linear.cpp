// A prefill chunk's block matmuls on AMX-BF16 tiles (Sapphire Rapids and later Xeons): y[M, N] =
// x[M, K] @ W^T with W packed GGUF blocks (any format gguf_linear takes), and the fused
// SiLU(gate) * up of a gate/up matrix; gguf_linear_bf16_out writes y into a column slice of a wider
// output. x and the weights are rounded to bf16 (to nearest, ties to
// even, as torch's `.to(torch.bfloat16)`); the products and their sums are fp32 (TDPBF16PS); the
// output is fp32. No dense copy of W is kept: each thread decodes a panel of output features at a
// time (Q4_K, Q6_K and the strip formats Q4_1, Q5_0, Q8_0 straight to bf16; the other formats through
// gguf_decode_range's exact fp32, then bf16) into a buffer that stays in its L2.
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
#include <new>
#include <vector>

#include "amx_tiles.h"      // KVSERVE_AMX, configure_full_tiles
#include "block_codes.h"    // the K-quant layouts: q4_k_scales, q6_k_codes
#include "cpu_features.h"   // cpu_has_amx_bf16
#include "quant_linear.h"   // gguf_decode_range, prefetch_range
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

// A vector whose data starts on a cache line: a tile's 64-byte rows then each lie in one line
// (std::vector's own memory is 16-byte aligned, so every tile row straddled two).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using Lines = std::vector<T, LineAligned<T>>;

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
  Lines<float> rows;      // [16][kc] fp32: a group decoded (the formats decode_panel does not take straight)
  Lines<uint16_t> panel;  // [features][panel_stride(kc)] bf16
  Lines<float> acc;       // [groups][row tiles][16][16]
};

// ---- Q4_K and Q6_K super-blocks (and the strip formats, below) straight to bf16 panel rows: the values
// quant_linear.cpp's decoders compute (gguf_decode_range: per sub-block fma(d sc, q, -(dmin m)) for
// Q4_K, fma(d sc, q, -32 d sc) for Q6_K, the scale products exact in fp32), 16 at a time in zmm, then
// rounded as bf16_32 rounds them: the same bf16 bits (tests/engine/kernels/test_prefill_linear_kernel.py,
// the one-hot rows).
// Through gguf_decode_range (8 at a time in ymm, an fp32 row buffer, then bf16_32) the decode was
// 76 TSC ticks a Q4_K super-block in cache here, and the 1B Q4_K_M's gate/up at 50 rows spent 60% of
// its call there; straight, 50 ticks, and the 1B's 200-row prefill step took 0.8x the time. Q4_1's
// strips (strip_bf16) likewise: one thread's decode of SmolLM2's gate/up 0.53x the ticks, its
// 400-row prefill step in process 0.92-0.95x the time, a 1,000-token prompt 0.88-0.95x. Q5_0's and
// Q8_0's strips since: the bf16 column of `bench.probes.quant_linear --int8` on SmolLM2 Q4_K_M's
// matrices (2 threads) 0.65x the time for Q5_0's gate/up at 64 rows, 0.56x for the Q8_0 LM head.

// 16 codes (uint8 in v) times the scale at a plus the offset at off, as 16 fp32.
inline __m512 scaled16(__m128i v, const float* a, const float* off) {
  return _mm512_fmadd_ps(_mm512_set1_ps(*a), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), _mm512_set1_ps(*off));
}

// 32 codes as 32 bf16 at dst (64-byte aligned): the first 16 with scale a[0] and offset off[0], the
// others with a[i] and off[i].
inline void scaled_bf16_32(__m256i v, const float* a, const float* off, int i, uint16_t* dst) {
  const __m512 lo = scaled16(_mm256_castsi256_si128(v), a, off);
  const __m512 hi = scaled16(_mm256_extracti128_si256(v, 1), a + i, off + i);
  _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// One Q4_K super-block (256 weights) as bf16 at dst.
inline void q4_k_bf16(const uint8_t* b, uint16_t* dst) {
  // f[j] = d sc_j, f[8 + j] = -(dmin m_j) (6-bit integers times an fp16: exact in fp32)
  const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(kvserve::q4_k_scales(b)));
  const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(fp16_at(b)), _mm256_set1_ps(-fp16_at(b + 2)), 1);
  alignas(64) float f[16];
  _mm512_store_ps(f, _mm512_mul_ps(sm, dd));
  const __m256i mask = _mm256_set1_epi8(15);
  for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
    scaled_bf16_32(_mm256_and_si256(q, mask), f + 2 * c, f + 8 + 2 * c, 0, dst + 64 * c);
    scaled_bf16_32(_mm256_and_si256(_mm256_srli_epi16(q, 4), mask), f + 2 * c + 1, f + 9 + 2 * c, 0, dst + 64 * c + 32);
  }
}

// One Q6_K super-block (256 weights) as bf16 at dst.
inline void q6_k_bf16(const uint8_t* b, uint16_t* dst) {
  // f[i] = d sc_i (an int8 times an fp16: exact), f[16 + i] = -32 f[i]; scale i covers 16 weights
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m512 a = _mm512_mul_ps(_mm512_set1_ps(fp16_at(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
  alignas(64) float f[32];
  _mm512_store_ps(f, a);
  _mm512_store_ps(f + 16, _mm512_mul_ps(a, _mm512_set1_ps(-32.f)));
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];
    kvserve::q6_k_codes(b, h, q);
    for (int c = 0; c < 4; ++c)
      scaled_bf16_32(q[c], f + 8 * h + 2 * c, f + 16 + 8 * h + 2 * c, 1, dst + 128 * h + 32 * c);
  }
}

// Four features' 32 codes of a strip-block, each feature's in k order, as 16-code rows of k_order:
// feature c0 + L's k 0-15 at k_order[0] + 16 L, k 16-31 at k_order[1] + 16 L. The nibble formats
// (block_codes.h: 4 chunks o of 32 bytes, byte 4c + e of chunk o holding feature c's codes at k =
// 8o + e in its low nibble and 8o + 4 + e in its high; Q5_0's fifth bits at byte 144, bit 2o of byte
// 4c + e for the low nibble, 2o + 1 for the high): feature c's 4 code dwords are dwords 8o + c of
// the 128 code bytes, so one dword permutation gathers 4 features, and the low and high nibbles
// interleave by dwords into k order. Q8_0 (byte 16 + 32j + 4c + e: feature c's code at k = 4j + e):
// dwords 8j + c, two permutations (k-quads 0-3, 4-7).
template <int64_t kFmt>
inline void strip_codes(const uint8_t* sb, int c0, uint8_t (*k_order)[64]) {
  const __m512i lane = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(c0), lane);  // lane L, dword i: dword 8i + c0 + L
  if constexpr (kFmt == kvserve::blocks::kQ8_0) {
    const uint8_t* q = sb + 16;
    _mm512_store_si512(k_order[0], _mm512_permutex2var_epi32(_mm512_loadu_si512(q), idx, _mm512_loadu_si512(q + 64)));
    _mm512_store_si512(k_order[1],
                       _mm512_permutex2var_epi32(_mm512_loadu_si512(q + 128), idx, _mm512_loadu_si512(q + 192)));
  } else {
    constexpr bool kQ5 = kFmt == kvserve::blocks::kQ5_0;
    const uint8_t* q = sb + (kQ5 ? 16 : 32);
    const __m512i x = _mm512_permutex2var_epi32(_mm512_loadu_si512(q), idx, _mm512_loadu_si512(q + 64));
    const __m512i mask = _mm512_set1_epi8(15);
    __m512i lo = _mm512_and_si512(x, mask), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
    if constexpr (kQ5) {
      // lane L, dword o: fifth-bit dword c0 + L shifted right by 2o, so that bit 0 of each byte is
      // the low nibble's fifth bit and bit 1 the high nibble's (2o + 1 <= 7: within the byte)
      const __m512i f = _mm512_permutexvar_epi32(
          _mm512_add_epi32(_mm512_set1_epi32(c0), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)),
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 144))));
      const __m512i t = _mm512_srlv_epi32(f, _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6));
      lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(t, _mm512_set1_epi8(1)), 4));
      hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(t, _mm512_set1_epi8(2)), 3));
    }
    _mm512_store_si512(k_order[0], _mm512_unpacklo_epi32(lo, hi));  // chunk o's low, its high: k 8o .. 8o + 7
    _mm512_store_si512(k_order[1], _mm512_unpackhi_epi32(lo, hi));
  }
}

// One strip-block (8 features x 32 k) of Q4_1, Q5_0 or Q8_0 as rows 0 .. cols - 1 of dst (stride
// ld), 32 bf16 each: the values quant_linear.cpp's decoders compute (Avx2Nibbles, Avx2<Q8_0>):
// fma(d, q, m) for Q4_1, fma(d, q, -16 d) for Q5_0 (= d (q - 16), exact), d q for Q8_0.
template <int64_t kFmt>
inline void strip_bf16(const uint8_t* sb, uint16_t* dst, int64_t ld, int cols) {
  constexpr bool kQ8 = kFmt == kvserve::blocks::kQ8_0, kQ5 = kFmt == kvserve::blocks::kQ5_0;
  alignas(32) float d[8], m[8];
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
  _mm256_store_ps(d, dv);
  if constexpr (kQ5)
    _mm256_store_ps(m, _mm256_mul_ps(dv, _mm256_set1_ps(-16.f)));
  else if constexpr (!kQ8)
    _mm256_store_ps(m, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16))));
  alignas(64) uint8_t k_order[2][64];
  for (int c0 = 0; c0 < cols; c0 += 4) {
    strip_codes<kFmt>(sb, c0, k_order);
    for (int c = c0; c < std::min(cols, c0 + 4); ++c) {
      const __m512 D = _mm512_set1_ps(d[c]);
      const auto value = [&](int h) {
        const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(k_order[h] + 16 * (c - c0)));
        if constexpr (kQ8) return _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
        else return _mm512_fmadd_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(m[c]));
      };
      _mm512_store_si512(dst + c * ld, (__m512i)_mm512_cvtne2ps_pbh(value(1), value(0)));
    }
  }
}

// The features [n0, n0 + 16) at k [k0, k0 + kc) of a strip-format matrix (two strips: Q4_1, Q5_0,
// Q8_0) as bf16 rows dst (row stride ld), those from `valid` on as zeros; the strips of `ahead` (or
// -1) are asked into L2 as decode_group_kquant does.
template <int64_t kFmt>
void decode_group_strips(const Problem& p, int64_t n0, int64_t valid, int64_t ahead, int64_t ahead_valid, int64_t k0,
                         int64_t kc, uint16_t* dst, int64_t ld) {
  constexpr int64_t kBytes = kvserve::blocks::strip_block_bytes(kFmt), kCols = kvserve::blocks::kStripColumns;
  const int64_t blocks = p.K / 32, b0 = k0 / 32, b1 = (k0 + kc) / 32;
  for (int64_t i = 0; i < 2; ++i) {
    uint16_t* rows = dst + i * kCols * ld;
    const int cols = static_cast<int>(std::clamp<int64_t>(valid - i * kCols, 0, kCols));
    for (int c = cols; c < kCols; ++c) std::memset(rows + c * ld, 0, kc * sizeof(uint16_t));
    if (cols == 0) continue;
    if (i * kCols < ahead_valid)
      kvserve::prefetch_range(p.w + ((ahead / kCols + i) * blocks + b0) * kBytes, (b1 - b0) * kBytes);
    const uint8_t* strip = p.w + ((n0 / kCols) + i) * blocks * kBytes;
    for (int64_t b = b0; b < b1; ++b) strip_bf16<kFmt>(strip + b * kBytes, rows + b * 32 - k0, ld, cols);
  }
}

// The features [n0, n0 + 16) at k [k0, k0 + kc) of a Q4_K or Q6_K matrix as bf16 rows dst (row stride
// ld), those from `valid` on as zeros. The rows of `ahead` (the next group's first feature, or -1;
// its rows up to ahead_valid) are asked into L2 as these are decoded: a group is ~2 us of work, and
// the panels' rows are read once, from memory.
void decode_group_kquant(const Problem& p, int64_t n0, int64_t valid, int64_t ahead, int64_t ahead_valid, int64_t k0,
                         int64_t kc, uint16_t* dst, int64_t ld) {
  const bool q4 = p.format == kvserve::blocks::kQ4_K;
  const int64_t bytes = q4 ? kvserve::blocks::kQ4_KBytes : kvserve::blocks::kQ6_KBytes, nb = p.K / 256;
  const int64_t sb0 = k0 / 256, sb1 = (k0 + kc) / 256;
  for (int64_t f = 0; f < kTile; ++f, dst += ld) {
    if (f >= valid) {
      std::memset(dst, 0, kc * sizeof(uint16_t));
      continue;
    }
    if (f < ahead_valid) kvserve::prefetch_range(p.w + ((ahead + f) * nb + sb0) * bytes, (sb1 - sb0) * bytes);
    const uint8_t* row = p.w + (n0 + f) * nb * bytes;
    for (int64_t sb = sb0; sb < sb1; ++sb) {
      if (q4) q4_k_bf16(row + sb * bytes, dst + sb * 256 - k0);
      else q6_k_bf16(row + sb * bytes, dst + sb * 256 - k0);
    }
  }
}

// Decode the panel's groups (group g: the 16 matrix rows from first[g], those past the gate's or
// the matrix's end as zeros) at k [k0, k0 + kc) into s.panel as bf16 rows: Q4_K, Q6_K and the strip
// formats straight (decode_group_kquant, decode_group_strips), Q5_K through gguf_decode_range's fp32.
void decode_panel(const Problem& p, const std::vector<int64_t>& first, int64_t k0, int64_t kc, Scratch& s) {
  const int64_t groups = static_cast<int64_t>(first.size()), ld = panel_stride(kc);
  const bool kquant = p.format == kvserve::blocks::kQ4_K || p.format == kvserve::blocks::kQ6_K;
  const bool strips = kvserve::blocks::is_strip_format(p.format);
  // the rows of group g that the matrix has (the gate's end for a gate group of swiglu)
  const auto valid = [&](int64_t g) {
    const int64_t limit = p.half && first[g] < p.half ? p.half : p.N;
    return std::max<int64_t>(0, std::min(kTile, limit - first[g]));
  };
  s.panel.resize(groups * kTile * ld);
  if (!kquant && !strips) s.rows.resize(kTile * kc);
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* panel = s.panel.data() + g * kTile * ld;
    if (kquant || strips) {
      const bool last = g + 1 == groups;
      const int64_t ahead = last ? -1 : first[g + 1], ahead_valid = last ? 0 : valid(g + 1);
      const int64_t n0 = first[g], n = valid(g);
      if (kquant) decode_group_kquant(p, n0, n, ahead, ahead_valid, k0, kc, panel, ld);
      else if (p.format == kvserve::blocks::kQ4_1)
        decode_group_strips<kvserve::blocks::kQ4_1>(p, n0, n, ahead, ahead_valid, k0, kc, panel, ld);
      else if (p.format == kvserve::blocks::kQ5_0)
        decode_group_strips<kvserve::blocks::kQ5_0>(p, n0, n, ahead, ahead_valid, k0, kc, panel, ld);
      else
        decode_group_strips<kvserve::blocks::kQ8_0>(p, n0, n, ahead, ahead_valid, k0, kc, panel, ld);
      continue;
    }
    float* rows = s.rows.data();
    const int64_t n = valid(g);
    if (n > 0) kvserve::gguf_decode_range(p.w, p.K, p.format, first[g], first[g] + n, k0, k0 + kc, rows, kc);
    std::memset(rows + n * kc, 0, (kTile - n) * kc * sizeof(float));
    for (int64_t f = 0; f < kTile; ++f)
      for (int64_t k = 0; k < kc; k += 32) _mm512_storeu_si512(panel + f * ld + k, bf16_32(rows + f * kc + k));
  }
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
  Lines<uint16_t> xb(tiles * p.K * kTile);
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
