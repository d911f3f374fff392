// The per-sequence decode attention of paged_attention.cpp, shared with decode_layer.cpp.
// fp32 queries and outputs; the pools are fp32, fp16 (``--kv-cache-dtype float16``: widened to
// fp32 as they are read) or int8 codes with per-token-per-head (step, minimum) scales
// (engine/kv/int8.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/Half.h>

#include "cpu_features.h"  // KVSERVE_X86, cpu_has_avx2
#include "vec_math.h"      // exp_nonpositive, hsum8

namespace kvserve {

struct Layout {
  const int64_t* table;  // this sequence's block ids
  int64_t len;           // cached tokens to attend to
  int64_t block_size;
  int64_t token_stride;  // elements between consecutive tokens of a block (kv_heads * head_dim)
  int64_t block_stride;  // elements between blocks
};

// One K or V pool. fp32 and fp16 (c10::Half): ``data`` holds the values. int8 (engine/kv/int8.py): ``data`` holds
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

// One row of L scores in place: s_t <- exp(s_t - m), m the row's maximum; returns (m, the sum).
inline std::pair<float, float> exp_row(float* s, int64_t L) {
  // The maximum in 16 independent lanes: one running maximum was a chain of dependent maxss (GCC
  // does not vectorize it), ~16% of a 4,000-token row's attention in perf; a one-row decode step
  // at ~4,100 tokens of context 13-15% faster (p10 of the steps). Exact in any order.
  float lanes[16];
  std::fill(lanes, lanes + 16, s[0]);
  int64_t u = 0;
  for (; u + 16 <= L; u += 16)
    for (int i = 0; i < 16; ++i) lanes[i] = std::max(lanes[i], s[u + i]);
  for (; u < L; ++u) lanes[0] = std::max(lanes[0], s[u]);
  const float m = *std::max_element(lanes, lanes + 16);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < L; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    sum += s[t];
  }
  return {m, sum};
}

// Softmax in place over each of the nh rows of L scores (exp_row, then divided by its sum).
inline void softmax_rows(float* scores, int64_t nh, int64_t L) {
  for (int64_t h = 0; h < nh; ++h) {
    float* s = scores + h * L;
    const float inv = 1.f / exp_row(s, L).second;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
}

// The softmax's first half, for a chunk of a context whose other chunks are attended apart
// (merge_chunks): per row of L scores, stats[2 h] = the row's maximum m and stats[2 h + 1] =
// sum_t exp(s_t - m), and the scores become exp(s_t - m), not divided by that sum.
inline void exp_rows(float* scores, int64_t nh, int64_t L, float* stats) {
  for (int64_t h = 0; h < nh; ++h) {
    const auto [m, sum] = exp_row(scores + h * L, L);
    stats[2 * h] = m, stats[2 * h + 1] = sum;
  }
}

// One row's attention from its n chunks (attend_chunk): chunk c's heads hold acc_c = sum_t
// exp(s_t - m_c) v_t at parts + c * ld (head h at h * D) and (m_c, l_c) at stats + c * 2 * H;
// out[h] = sum_c w_c acc_c[h] / sum_c w_c l_c[h], w_c = exp(m_c - max_c m_c): the softmax over the
// whole context, up to fp32 rounding.
inline void merge_chunks(const float* parts, const float* stats, int64_t n, int64_t ld, int64_t H, int64_t D,
                         float* out) {
  for (int64_t h = 0; h < H; ++h) {
    float m = stats[2 * h];
    for (int64_t c = 1; c < n; ++c) m = std::max(m, stats[c * 2 * H + 2 * h]);
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    float sum = 0.f;
    for (int64_t c = 0; c < n; ++c) {
      const float* st = stats + c * 2 * H + 2 * h;
      const float w = exp_nonpositive(st[0] - m);
      sum += w * st[1];
      const float* a = parts + c * ld + h * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[i] += w * a[i];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}

// H2O's per-block attention mass (cache/eviction/h2o.py): mass[j] += the probabilities of the
// nh rows of L in block j (tokens [j * block_size, (j + 1) * block_size)), from the softmax the
// values are weighed with: no second pass over K or V.
inline void add_block_mass(const float* probs, int64_t nh, int64_t L, int64_t block_size, float* mass) {
  for (int64_t t0 = 0, j = 0; t0 < L; t0 += block_size, ++j) {
    const int64_t t1 = std::min(L, t0 + block_size);
    float s = 0.f;
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t t = t0; t < t1; ++t) s += probs[h * L + t];
    mass[j] += s;
  }
}

#ifdef KVSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Token rows a head's first pass asks for ahead of use: the pools' blocks sit anywhere, so the
// hardware prefetcher cannot follow a sequence across them.
constexpr int64_t kRowsAhead = 16;


// 8 values of a float or fp16 pool as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Query heads sharing a kv head are taken together, up to kGroup at a time, so that each K and V
// value is loaded (and, from an fp16 pool, widened) once for all of them rather than once per head.
constexpr int kGroup = 4;

// scores[g * ldS + t] = scale * q_g . k_t for the NG heads g whose queries are q + g * D, over the
// L tokens whose key rows are krows[t] + off: 4 tokens at a time into 4 NG accumulators, each
// head's 4 reduced together by horizontal adds. With ahead_bytes > 0, the key rows kRowsAhead
// tokens on are prefetched from ahead0, that many bytes, and so are the value rows (vrows) the
// V pass will read next.
template <int NG, typename T>
inline void dots_group(const float* q, int64_t D, const T* const* krows, int64_t off, int64_t L, float scale,
                       float* scores, int64_t ldS, int64_t ahead0, int64_t ahead_bytes, const T* const* vrows) {
  const int64_t nv = D / 8;
  const __m128 sc = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    const T* kt[4] = {krows[t] + off, krows[t + 1] + off, krows[t + 2] + off, krows[t + 3] + off};
    if (ahead_bytes)
      for (int64_t j = t + kRowsAhead; j < std::min(L, t + kRowsAhead + 4); ++j)
        prefetch_row(krows[j] + ahead0, ahead_bytes), prefetch_row(vrows[j] + ahead0, ahead_bytes);
    __m256 a[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nv; ++c) {
      __m256 x[4];
      for (int i = 0; i < 4; ++i) x[i] = load8(kt[i] + 8 * c);
      for (int g = 0; g < NG; ++g) {
        const __m256 qc = _mm256_loadu_ps(q + g * D + 8 * c);
        for (int i = 0; i < 4; ++i) a[g][i] = _mm256_fmadd_ps(qc, x[i], a[g][i]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      // [a0 a1 a2 a3 partial sums | the other halves] -> the 4 dot products
      const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
      const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1));
      _mm_storeu_ps(scores + g * ldS + t, _mm_mul_ps(dots, sc));
    }
  }
  for (; t < L; ++t) {
    const T* kt = krows[t] + off;
    for (int g = 0; g < NG; ++g) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t c = 0; c < nv; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * c), load8(kt + 8 * c), a);
      scores[g * ldS + t] = hsum8(a) * scale;
    }
  }
}

template <typename T>
struct TileLines;

// out[g * D + 0 .. 8 NV) = sum_t p[g * ldP + t] rows[t][offset ..] for the NG heads g: the NG x NV
// accumulators stay in registers across the tokens and each row slice is loaded once for all
// heads. attend_avx2's order (a group over its whole range): with ahead_bytes > 0, rows[t +
// kRowsAhead][ahead0 ..] is prefetched, that many bytes. Tiles (kAdd, attend_tiles): the sums are
// added to out, and each token asks `lines` for its rate. (The prefetches are arguments, not a
// callable, so that the one-group jobs compile to the code they were measured with: passed a
// lambda, GCC laid that code out anew.)
template <int NG, int NV, bool kAdd, typename T>
inline void weighted_sum(const T* const* rows, int64_t L, const float* p, int64_t ldP, int64_t offset, float* out,
                         int64_t D, int64_t ahead0, int64_t ahead_bytes, TileLines<T>* lines) {
  __m256 a[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = kAdd ? _mm256_loadu_ps(out + g * D + 8 * i) : _mm256_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const T* vt = rows[t] + offset;
    if constexpr (kAdd)
      lines->ask(lines->rate);
    else if (ahead_bytes && t + kRowsAhead < L)
      prefetch_row(rows[t + kRowsAhead] + ahead0, ahead_bytes);
    __m256 x[NV];
    for (int i = 0; i < NV; ++i) x[i] = load8(vt + 8 * i);
    for (int g = 0; g < NG; ++g) {
      const __m256 pt = _mm256_set1_ps(p[g * ldP + t]);
      for (int i = 0; i < NV; ++i) a[g][i] = _mm256_fmadd_ps(pt, x[i], a[g][i]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + g * D + 8 * i, a[g][i]);
}

// The V pass of NG heads over all nv = D / 8 channel vectors: slices of 8 vectors (4 when 3 or 4
// heads share the registers), then 4, 2, 1; only the first slice prefetches.
template <int NG, typename T>
inline void values_group(const T* const* rows, int64_t L, const float* p, int64_t ldP, int64_t off, int64_t D,
                         int64_t ahead0, int64_t ahead_bytes, float* out) {
  const int64_t nv = D / 8;
  int64_t c = 0;
  const auto ahead = [&](int64_t c) { return c == 0 ? ahead_bytes : 0; };
  TileLines<T>* const none = nullptr;
  if constexpr (NG <= 2)
    for (; c + 8 <= nv; c += 8)
      weighted_sum<NG, 8, false>(rows, L, p, ldP, off + 8 * c, out + 8 * c, D, ahead0, ahead(c), none);
  for (; c + 4 <= nv; c += 4)
    weighted_sum<NG, 4, false>(rows, L, p, ldP, off + 8 * c, out + 8 * c, D, ahead0, ahead(c), none);
  if (c + 2 <= nv) weighted_sum<NG, 2, false>(rows, L, p, ldP, off + 8 * c, out + 8 * c, D, ahead0, ahead(c), none), c += 2;
  if (c < nv) weighted_sum<NG, 1, false>(rows, L, p, ldP, off + 8 * c, out + 8 * c, D, ahead0, ahead(c), none);
}

// attend() for fp32 and fp16 pools and D % 8 == 0 (the same contract). The heads go in groups of
// up to kGroup sharing one kv head: q . k (dots_group), then the softmax of every head, then the
// probability-weighted V rows (values_group). The first group streams the rows' kv heads
// [h0 / G, (h1 - 1) / G] from memory (prefetched kRowsAhead tokens on, whole rows when the job
// has every head, so that blocks are read as they lie); the other groups find them in cache.
// The job's first kRowsAhead K and V rows are asked for before any work, and each pass over K
// prefetches V too: a job had started on a cold pool twice (its K pass, then its V pass),
// which in a decode step, where the weights have swept the caches, is where attention waited
// (native layers of a step 3% faster at 16 rows of ~150 tokens, 5% at one row of ~1,000).
//
// A chunk (stats not null): tokens [t0, t1) only, and instead of the softmax, exp_rows: out gets
// the heads' unnormalized sums and stats their (maximum, sum) for merge_chunks.
template <typename T>
inline void attend_avx2(
    const float* q, const Pool<T>& k, const Pool<T>& v, const Layout& lay, int64_t h0, int64_t h1,
    int64_t G, int64_t D, float scale, float* scores, float* out, float* mass, int64_t t0 = 0, int64_t t1 = -1,
    float* stats = nullptr) {
  if (t1 < 0) t1 = lay.len;
  const int64_t L = t1 - t0, nh = h1 - h0, bs = lay.block_size;
  thread_local std::vector<const T*> krows, vrows;
  krows.resize(L), vrows.resize(L);
  for (int64_t u = t0, t = 0; u < t1;) {  // block by block: no division per token
    const int64_t first = lay.table[u / bs] * bs + u % bs, n = std::min(bs - u % bs, t1 - u);
    for (int64_t i = 0; i < n; ++i, ++t)
      krows[t] = k.data + (first + i) * lay.token_stride, vrows[t] = v.data + (first + i) * lay.token_stride;
    u += n;
  }
  const int64_t ahead0 = (h0 / G) * D, ahead_bytes = ((h1 - 1) / G + 1 - h0 / G) * D * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < std::min(L, kRowsAhead); ++t)
    prefetch_row(krows[t] + ahead0, ahead_bytes), prefetch_row(vrows[t] + ahead0, ahead_bytes);
  // calls fn(h, n, off): heads [h, h + n) share the kv head whose values start at off
  const auto for_each_group = [&](auto&& fn) {
    for (int64_t h = h0; h < h1;) {
      const int64_t n = std::min<int64_t>({kGroup, h1 - h, (h / G + 1) * G - h});
      fn(h, n, (h / G) * D);
      h += n;
    }
  };
  for_each_group([&](int64_t h, int64_t n, int64_t off) {
    const float* qh = q + h * D;
    float* s = scores + (h - h0) * L;
    const int64_t pf = h == h0 ? ahead_bytes : 0;
    switch (n) {
      case 1: dots_group<1>(qh, D, krows.data(), off, L, scale, s, L, ahead0, pf, vrows.data()); break;
      case 2: dots_group<2>(qh, D, krows.data(), off, L, scale, s, L, ahead0, pf, vrows.data()); break;
      case 3: dots_group<3>(qh, D, krows.data(), off, L, scale, s, L, ahead0, pf, vrows.data()); break;
      default: dots_group<4>(qh, D, krows.data(), off, L, scale, s, L, ahead0, pf, vrows.data()); break;
    }
  });
  if (stats)
    exp_rows(scores, nh, L, stats);
  else
    softmax_rows(scores, nh, L);
  if (mass) add_block_mass(scores, nh, L, lay.block_size, mass);
  for_each_group([&](int64_t h, int64_t n, int64_t off) {
    const float* p = scores + (h - h0) * L;
    float* o = out + h * D;
    const int64_t pf = h == h0 ? ahead_bytes : 0;
    switch (n) {
      case 1: values_group<1>(vrows.data(), L, p, L, off, D, ahead0, pf, o); break;
      case 2: values_group<2>(vrows.data(), L, p, L, off, D, ahead0, pf, o); break;
      case 3: values_group<3>(vrows.data(), L, p, L, off, D, ahead0, pf, o); break;
      default: values_group<4>(vrows.data(), L, p, L, off, D, ahead0, pf, o); break;
    }
  });
}

// ---- A chunk of every head in tiles (attend_chunk). The order above (each group over the whole
// range, the first prefetching rows on) reads a chunk's rows from memory for its first group and
// from L2 or L3 for the 7 others of a 1B model's 32 heads (256 tokens of K and V rows, 512 KB in
// fp16, fill a Zen 3 core's L2): a row of 1,000 fp16 tokens took 4.5-4.9 ms over 16 such layers
// from memory on 2 threads, against 2.9-4.4 ms in tiles, and one of 4,000 tokens 15.8-23.8 ms
// against 11.0-12.1 (the same floats; docs/benchmarks.md, "a sixteenth session"). For the
// one-group jobs of attend_avx2 (a kv head's 4 heads) the tiled order with these prefetches
// measured slower, and so did one version of both orders (the cause not found): each order keeps
// its own K loop and slicing of the V pass (dots_group / values_group, dots_tile / values_tile);
// the V sums are one weighted_sum, each order passing in its prefetches.

// Tokens a tile.
constexpr int64_t kTile = 16;
// A chunk whose K and V rows fit this (half a Zen 3 core's L2) has its V rows asked for by its K
// pass, so that the V pass finds them in cache.
constexpr int64_t kCachedBytes = 256 << 10;

// The cache lines of rows [t0, t1) (per lines each, from off), row by row: a row's lines of rows,
// then (with both) of both. ask(n) asks for n more of lines [next, end): a tile's work deals out
// the next tile's lines, a share to each group, `rate` a step. Asked for in one burst at a tile's
// start they waited for the core's miss buffers while the products idled, and the memory idled
// while the products ran (the pattern of quant_linear_q8.cpp's LineSpan).
template <typename T>
struct TileLines {
  const T* const* rows = nullptr;
  const T* const* both = nullptr;
  int64_t t0 = 0, t1 = 0, off = 0, per = 1, next = 0, end = 0, rate = 0;

  int64_t row_lines() const { return both ? 2 * per : per; }
  int64_t count() const { return (t1 - t0) * row_lines(); }
  void ask(int64_t n) {
    n = std::min(n, end - next);
    if (n <= 0) return;
    const int64_t rl = row_lines();
    int64_t t = t0 + next / rl, j = next % rl;  // one division a call, none a line
    for (next += n; n > 0; --n) {
      const T* row = j < per ? rows[t] : both[t];
      __builtin_prefetch(reinterpret_cast<const char*>(row + off) + 64 * (j < per ? j : j - per));
      if (++j == rl) j = 0, ++t;
    }
  }
};

// dots_group's reduction, one order for 2 or 4 dot products ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)):
// [a, b, a, b] and [a, b, c, d].
inline __m128 dots2(__m256 a, __m256 b) {
  __m256 h = _mm256_hadd_ps(a, b);
  h = _mm256_hadd_ps(h, h);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline __m128 dots4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// dots_group over one tile's L tokens, asking for `lines` (rate a step): NT = 4 tokens a step for 1
// or 2 heads, 2 for 3 or 4 (4 x 4 accumulators spilled; 2 tokens of two heads share a dots4).
template <int NG, typename T>
inline void dots_tile(const float* q, int64_t D, const T* const* krows, int64_t off, int64_t L, float scale,
                      float* scores, int64_t ldS, TileLines<T>& lines) {
  constexpr int NT = NG <= 2 ? 4 : 2;
  const int64_t nv = D / 8;
  const __m128 sc = _mm_set1_ps(scale);
  for (int64_t t = 0; t < L; t += NT) {
    lines.ask(lines.rate);
    const int nt = static_cast<int>(std::min<int64_t>(NT, L - t));  // a last short step: its first repeated
    const T* kt[NT];
    for (int i = 0; i < NT; ++i) kt[i] = krows[t + (i < nt ? i : 0)] + off;
    __m256 a[NG][NT];
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < NT; ++i) a[g][i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nv; ++c) {
      __m256 x[NT];
      for (int i = 0; i < NT; ++i) x[i] = load8(kt[i] + 8 * c);
      for (int g = 0; g < NG; ++g) {
        const __m256 qc = _mm256_loadu_ps(q + g * D + 8 * c);
        for (int i = 0; i < NT; ++i) a[g][i] = _mm256_fmadd_ps(qc, x[i], a[g][i]);
      }
    }
    __m128 d[NG];  // head g's nt dots from lane 0
    for (int g = 0; g < NG; ++g) {
      if constexpr (NT == 4) {
        d[g] = dots4(a[g][0], a[g][1], a[g][2], a[g][3]);
      } else if (g + 1 < NG) {
        d[g] = dots4(a[g][0], a[g][1], a[g + 1][0], a[g + 1][1]);
        d[g + 1] = _mm_movehl_ps(d[g], d[g]), ++g;
      } else {
        d[g] = dots2(a[g][0], a[g][1]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      float f[4];
      _mm_storeu_ps(f, _mm_mul_ps(d[g], sc));
      std::copy(f, f + nt, scores + g * ldS + t);
    }
  }
}

// values_group over one tile, added to out: slices of 4 vectors (2 with 3 or 4 heads, all in
// registers), then 2, then 1; the first slice asks for `lines`.
template <int NG, typename T>
inline void values_tile(const T* const* rows, int64_t L, const float* p, int64_t ldP, int64_t off, int64_t D,
                        float* out, TileLines<T>& lines) {
  const int64_t nv = D / 8;
  TileLines<T> none;
  int64_t c = 0;
  const auto ask = [&](int64_t c) { return c ? &none : &lines; };  // the first slice asks
  if constexpr (NG <= 2)
    for (; c + 4 <= nv; c += 4) weighted_sum<NG, 4, true>(rows, L, p, ldP, off + 8 * c, out + 8 * c, D, 0, 0, ask(c));
  for (; c + 2 <= nv; c += 2) weighted_sum<NG, 2, true>(rows, L, p, ldP, off + 8 * c, out + 8 * c, D, 0, 0, ask(c));
  if (c < nv) weighted_sum<NG, 1, true>(rows, L, p, ldP, off + 8 * c, out + 8 * c, D, 0, 0, ask(c));
}

// attend_avx2's chunk (stats: exp_rows, no block mass) in tiles of kTile tokens: every group's q . k
// on a tile, then the next tile; the exponentials; every group's V rows on a tile, then the next.
// Each group's work on a tile asks for its share of the next tile's lines (in the K pass's last
// tile, the V pass's first; the K pass asks for the V rows too where the chunk's fit kCachedBytes).
// The same floats as attend_avx2 but for the last 1-3 tokens' scores there (reduced by hsum8).
template <typename T>
inline void attend_tiles(const float* q, const Pool<T>& k, const Pool<T>& v, const Layout& lay, int64_t H, int64_t G,
                         int64_t D, float scale, int64_t t0, int64_t t1, float* scores, float* out, float* stats) {
  const int64_t L = t1 - t0, bs = lay.block_size;
  thread_local std::vector<const T*> krows, vrows;
  krows.resize(L), vrows.resize(L);
  for (int64_t u = t0, t = 0; u < t1;) {  // block by block: no division per token
    const int64_t first = lay.table[u / bs] * bs + u % bs, n = std::min(bs - u % bs, t1 - u);
    for (int64_t i = 0; i < n; ++i, ++t)
      krows[t] = k.data + (first + i) * lay.token_stride, vrows[t] = v.data + (first + i) * lay.token_stride;
    u += n;
  }
  const int64_t per = (lay.token_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;  // whole rows
  const bool v_in_k = 2 * L * per * 64 <= kCachedBytes;
  // calls fn(gi, h, n, off) for each group gi: heads [h, h + n) share the kv head whose values start at off
  const auto for_each_group = [&](auto&& fn) {
    for (int64_t h = 0, gi = 0; h < H; ++gi) {
      const int64_t n = std::min<int64_t>({kGroup, H - h, (h / G + 1) * G - h});
      fn(gi, h, n, (h / G) * D);
      h += n;
    }
  };
  int64_t groups = 0;
  for_each_group([&](int64_t, int64_t, int64_t, int64_t) { ++groups; });
  // the lines of rows [a, b) of rows (and of both); group gi's share of them, asked for in `steps`
  const auto lines_of = [&](const T* const* rows, const T* const* both, int64_t a, int64_t b) {
    a = std::min(a, L);
    return TileLines<T>{rows, both, a, std::max(a, std::min(L, b)), 0, per};
  };
  const auto share = [&](TileLines<T> lines, int64_t gi, int64_t steps) {
    const int64_t each = (lines.count() + groups - 1) / groups;
    lines.next = std::min(lines.count(), gi * each), lines.end = std::min(lines.count(), (gi + 1) * each);
    lines.rate = (lines.end - lines.next + steps - 1) / std::max<int64_t>(1, steps);
    return lines;
  };
  TileLines<T> first = lines_of(krows.data(), v_in_k ? vrows.data() : nullptr, 0, kTile);
  first.end = first.count();
  first.ask(first.end);
  for (int64_t t = 0; t < L; t += kTile) {
    const int64_t n_t = std::min(kTile, L - t);
    const TileLines<T> next = t + kTile < L
                                  ? lines_of(krows.data(), v_in_k ? vrows.data() : nullptr, t + kTile, t + 2 * kTile)
                                  : lines_of(vrows.data(), nullptr, v_in_k ? L : 0, kTile);
    for_each_group([&](int64_t gi, int64_t h, int64_t n, int64_t off) {
      TileLines<T> lines = share(next, gi, n <= 2 ? (n_t + 3) / 4 : (n_t + 1) / 2);
      const float* qh = q + h * D;
      float* s = scores + h * L + t;
      switch (n) {
        case 1: dots_tile<1>(qh, D, krows.data() + t, off, n_t, scale, s, L, lines); break;
        case 2: dots_tile<2>(qh, D, krows.data() + t, off, n_t, scale, s, L, lines); break;
        case 3: dots_tile<3>(qh, D, krows.data() + t, off, n_t, scale, s, L, lines); break;
        default: dots_tile<4>(qh, D, krows.data() + t, off, n_t, scale, s, L, lines); break;
      }
      lines.ask(lines.end);  // what the steps left
    });
  }
  exp_rows(scores, H, L, stats);
  std::fill(out, out + H * D, 0.f);
  for (int64_t t = 0; t < L; t += kTile) {
    const int64_t n_t = std::min(kTile, L - t);
    const TileLines<T> next = lines_of(vrows.data(), nullptr, v_in_k ? L : t + kTile, t + 2 * kTile);
    for_each_group([&](int64_t gi, int64_t h, int64_t n, int64_t off) {
      TileLines<T> lines = share(next, gi, n_t);
      const float* p = scores + h * L + t;
      float* o = out + h * D;
      switch (n) {
        case 1: values_tile<1>(vrows.data() + t, n_t, p, L, off, D, o, lines); break;
        case 2: values_tile<2>(vrows.data() + t, n_t, p, L, off, D, o, lines); break;
        case 3: values_tile<3>(vrows.data() + t, n_t, p, L, off, D, o, lines); break;
        default: values_tile<4>(vrows.data() + t, n_t, p, L, off, D, o, lines); break;
      }
      lines.ask(lines.end);
    });
  }
}

#pragma GCC pop_options
#endif

// Heads [h0, h1) of one sequence against its cached tokens. q [H, D] (this sequence's
// queries); k/v the pools; scores is scratch [h1 - h0, len]; acc scratch [h1 - h0, D];
// out [H, D] (this sequence's output rows). Every cached token's row of those heads is read
// once, in block order. With mass (one float per block of the table), the heads' probability
// mass per block is added to it (add_block_mass).
template <typename T>
inline void attend(const float* q, const Pool<T>& k, const Pool<T>& v, const Layout& lay, int64_t h0, int64_t h1,
            int64_t G, int64_t D, float scale, float* scores, float* acc, float* out, float* mass = nullptr) {
  constexpr bool quantized = std::is_same<T, int8_t>::value;
  constexpr bool widened = !std::is_same<T, float>::value;  // int8 codes or fp16 values
#ifdef KVSERVE_X86
  if constexpr (!quantized) {
    if (D % 8 == 0 && cpu_has_avx2()) return attend_avx2(q, k, v, lay, h0, h1, G, D, scale, scores, out, mass);
  }
#endif
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
  // int8 and fp16 rows are widened to fp32 once per token (the kv heads this job reads) into
  // ``row``, so the G query heads sharing a kv head reuse them and the dot products stay plain
  // fp32 loops.
  const int64_t kv0 = h0 / G, kv1 = (h1 - 1) / G + 1;
  float row_buf[widened ? 1024 : 1];
  std::vector<float> row_big;
  float* row = row_buf;
  if (widened && (kv1 - kv0) * D > 1024) {
    row_big.resize((kv1 - kv0) * D);
    row = row_big.data();
  }
  auto widen = [&](const T* src) -> const float* {
    if constexpr (widened) {
      const T* p = src + kv0 * D;
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
  softmax_rows(scores, nh, L);
  if (mass) add_block_mass(scores, nh, L, lay.block_size, mass);
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

// Contexts longer than this many tokens may be attended in chunks of it, each a work item of its
// own on every head, merged afterwards (merge_chunks), where the kernel has chunks
// (attend_chunks_supported). Why: one decode row has only kv_heads work items otherwise (3 for
// SmolLM2, on 2 threads: one thread does two), and a kv head's slice of each token row is 2 of its
// 6 cache lines; whole rows in chunks measured 84 against 134 us a row of 1,000 fp16 tokens on one
// thread. A row's chunks depend on its own length only, so its result does not depend on the rest
// of the batch.
constexpr int64_t kAttnChunk = 256;

// Whether attend_chunk runs here: the AVX2 kernel (x86 CPUs with it, head_dim a multiple of 8).
inline bool attend_chunks_supported(int64_t D) {
#ifdef KVSERVE_X86
  return D % 8 == 0 && cpu_has_avx2();
#else
  (void)D;
  return false;
#endif
}

// Every head of one sequence over its tokens [t0, t1) (attend_tiles; requires
// attend_chunks_supported): out [H, D] the unnormalized sums, stats [H, 2]; scores scratch [H, t1 - t0].
template <typename T>
inline void attend_chunk(const float* q, const Pool<T>& k, const Pool<T>& v, const Layout& lay, int64_t H, int64_t G,
                         int64_t D, float scale, int64_t t0, int64_t t1, float* scores, float* out, float* stats) {
#ifdef KVSERVE_X86
  attend_tiles(q, k, v, lay, H, G, D, scale, t0, t1, scores, out, stats);
#else
  (void)q, (void)k, (void)v, (void)lay, (void)H, (void)G, (void)D, (void)scale, (void)t0, (void)t1, (void)scores,
      (void)out, (void)stats;
#endif
}

}  // namespace kvserve
