// The many-row int8 matmuls on AMX tiles (Sapphire Rapids and later Xeons), from kAmxMinRows (32)
// rows (the strip pairs from kAmxStripMinRows, 32): batched decode and prefill, where the AVX-512 kernels of quant_linear_q8.cpp are compute
// bound (~80-150 GMAC/s per thread). Two kernels: the K-quants (Q4_K, Q5_K, Q6_K against Q8Act's
// per-256 activations), described here, and the Q4_1 / Q5_0 / Q8_0 strip pairs (see strip_pairs_amx
// below: per-32 scales, so one tile product per 32-block; one thread, 512 rows of 1536 x 576 Q4_1
// ~120 -> ~185 GMAC/s; Q8_0 ~1.1x; at 16 rows the vpdpbusd pairs are faster, quant_linear.h).
//
// Per 16 output features (a group) the codes are unpacked once per call with their sub-block
// scale folded in, v = sc q (see Group), and serve every 16-row tile of activations (Q8Act::kt,
// AMX's "VNNI" layout: 4-byte groups of the 16 rows side by side). Per tile and super-block two
// accumulating chains of tile products (TDPBUSD / TDPBSSD, K = 64 a product) give the exact
// integers I_lo and I_hi with A = I_lo + 256 I_hi = sum_j sc_j I_j; Q4_K / Q5_K's mins multiply
// the activations' 32-block code sums (Q8Act::ktsum, one vpdpwssd per two sub-blocks) into B.
// A and B reach fp32 as in quant_linear_q8.cpp's K-quant kernels: acc = fma(A, d dx, acc),
// corr = fma(B, dmin dx, corr), result acc - corr (Q6_K: signed codes q - 32, so no offset term
// and no corr). The integers are the same, the float operations the same and in the same order,
// so every output equals the AVX-512 / AVX2 kernels' bit for bit, and a row's result does not
// depend on the rows batched with it. Rows past M in the last tile are zeros, their results
// dropped.
//
// The weights are unpacked a slab of 2 super-blocks at a time (16 KB, in L1 with the activation
// tiles), each slab against every row tile; the next row tile's activations are prefetched during
// a tile's float work (a tile load that misses L1 had tripled the cost of the products). Measured
// (one thread, 4096 x 2048 Q4_K / 2048 x 4096 Q6_K, against the AVX-512 kernels): 16 rows 1.47 /
// 1.38 ms vs 1.39 / 1.70, 32 rows 1.76 / 2.01 vs 3.26 / 3.76, 512 rows 23 / 25 vs 47 / 60 ms. The
// tile products alone run ~3.3 TMAC/s per core; what bounds the kernel is the unpack (at 16 rows,
// once per call and row tile) and the per-super-block float work (16 x ~20 instructions per tile).
#include "block_codes.h"
#include "cpu_features.h"  // KVSERVE_X86, cpu_has_amx (defined here)
#include "quant_linear.h"

#include <algorithm>
#include <array>
#include <type_traits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx_tiles.h"  // KVSERVE_AMX (the compiler has the AMX intrinsics), TileConfig

#ifdef KVSERVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace kvserve::blocks;  // the BlockFormat codes and K-quant super-block bytes (block_codes.h)
constexpr int kTile = 16;  // activation rows per tile, output features per group

#ifdef KVSERVE_AMX
// AMX-TILE, AMX-INT8 and AVX512 F/BW/VL/VBMI/VNNI (the unpack and the float work), the kernel's permission to
// use tile data (Linux grants it per process on request), and neither KVSERVE_NO_AMX nor
// KVSERVE_NO_VNNI set. Once, at load.
bool detect_amx() {
  if (std::getenv("KVSERVE_NO_AMX") || std::getenv("KVSERVE_NO_VNNI") || std::getenv("KVSERVE_PORTABLE_KERNELS"))
    return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512 = (b >> 16 & 1) && (b >> 30 & 1) && (b >> 31 & 1) && (c >> 1 & 1) && (c >> 11 & 1);  // F BW VL VBMI VNNI
  const bool amx = (d >> 24 & 1) && (d >> 25 & 1);
  if (!avx512 || !amx) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // <asm/prctl.h>, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}
const bool kHasAmx = detect_amx();
#else
const bool kHasAmx = false;
#endif

}  // namespace

bool kvserve::cpu_has_amx() { return kHasAmx; }

#ifdef KVSERVE_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,amx-tile,amx-int8")

namespace {

using kvserve::k8_order;  // quant_linear.h

inline float half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return _cvtsh_ss(v);
}

// Every tile is 16 rows x 64 bytes: C (16 features x 16 activation rows of int32), A (16
// features x 64 bytes of weights along K), B (16 groups of 4 along K x 16 activation rows x 4).
void configure_tiles() { kvserve::configure_full_tiles(); }

// One group of 16 features, unpacked for the tiles. The sub-block scale is folded into each
// code: v = sc q (Q4_K, Q5_K: 0 <= v <= 63 * 31; Q6_K: |v| <= 128 * 32), as its low byte `lo`
// (unsigned) and the rest `hi` = v >> 8 (Q6_K signed), so that v = lo + 256 hi and a super-block's
// A = sum_k v_k x_k = I_lo + 256 I_hi: two accumulating tile products of K = 64 per 64 weights.
// (One product per sub-block, each scaled by an int32 multiply after it, had prefilled ~10% slower.)
// Layout: lo, hi [sb][64-weight chunk][feature][64]; d, dmin [sb][feature]; mins [sb][feature][4]
// (Q4_K, Q5_K: the mins of sub-blocks 2p, 2p + 1 as an int16 pair).
struct Group {
  std::vector<int8_t> lo, hi;
  std::vector<int32_t> mins;
  std::vector<float> d, dmin;
  std::vector<float> acc, corr;  // [tile][feature][row]: the running sums across slabs
  void resize(int64_t nb) {
    lo.resize(nb * 4 * kTile * 64), hi.resize(lo.size()), mins.resize(nb * kTile * 4), d.resize(nb * kTile);
    dmin.resize(nb * kTile);
  }
};

// Two vectors of 32 int16 products (64 weights along K, in order) -> the 64 low bytes at lo and
// the 64 high bytes at hi (the odd bytes: v >> 8, arithmetic, so Q6_K's negative v split right),
// one byte permute each.
inline void store_split(__m512i v0, __m512i v1, int8_t* lo, int8_t* hi) {
  static constexpr auto kEven = [] {  // constant: no guarded static initialization in the unpack loop
    std::array<int8_t, 64> b{};
    for (int i = 0; i < 64; ++i) b[i] = static_cast<int8_t>(2 * i);
    return b;
  }();
  const __m512i even = _mm512_loadu_si512(kEven.data());
  _mm512_storeu_si512(lo, _mm512_permutex2var_epi8(v0, even, v1));
  _mm512_storeu_si512(hi, _mm512_permutex2var_epi8(v0, _mm512_add_epi8(even, _mm512_set1_epi8(1)), v1));
}

using kvserve::q4_k_scales;  // block_codes.h

// Q4_K / Q5_K (kQ5): w = d sc_j q - dmin m_j, sub-blocks j of 32, q 4 (5) bits.
template <bool kQ5>
void unpack_q4_k(const uint8_t* w, int64_t n, int64_t nb, int64_t sb0, int64_t sb1, Group& g) {
  constexpr int64_t kBytes = kQ5 ? kQ5_KBytes : kQ4_KBytes, kCodes = kQ5 ? 48 : 16;
  g.resize(sb1 - sb0);
  int8_t *const glo = g.lo.data(), *const ghi = g.hi.data();  // locals: int8 stores would make the compiler reload them
  int32_t* const gmins = g.mins.data();
  float *const gd = g.d.data(), *const gdmin = g.dmin.data();
  const __m512i mask = _mm512_set1_epi16(15), one = _mm512_set1_epi16(1);
  for (int f = 0; f < kTile; ++f) {
    const uint8_t* row = w + (n + f) * nb * kBytes;
    for (int64_t sb = 0; sb < sb1 - sb0; ++sb) {
      const uint8_t* b = row + (sb0 + sb) * kBytes;
      const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(kvserve::u32_at(b))));  // [d, dmin]
      gd[sb * kTile + f] = _mm_cvtss_f32(dd), gdmin[sb * kTile + f] = _mm_cvtss_f32(_mm_movehdup_ps(dd));
      const __m128i sm = q4_k_scales(b);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(gmins + (sb * kTile + f) * 4), _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)));
      const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sm));  // int16 lanes 0-7
      const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
      for (int c = 0; c < 4; ++c) {  // 32 bytes: low nibbles sub-block 2c, high 2c + 1 (int16 lanes)
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kCodes + 32 * c)));
        __m512i q0 = _mm512_and_si512(v, mask), q1 = _mm512_srli_epi16(v, 4);
        if (kQ5) {  // bit j of qh[i] is the fifth bit of sub-block j's code i
          const auto bit = [&](int j) {
            return _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4);
          };
          q0 = _mm512_or_si512(q0, bit(2 * c)), q1 = _mm512_or_si512(q1, bit(2 * c + 1));
        }
        const int64_t at = ((sb * 4 + c) * kTile + f) * 64;
        const __m512i s0 = _mm512_permutexvar_epi16(_mm512_set1_epi16(static_cast<short>(2 * c)), sc);
        const __m512i s1 = _mm512_permutexvar_epi16(_mm512_set1_epi16(static_cast<short>(2 * c + 1)), sc);
        store_split(_mm512_mullo_epi16(q0, s0), _mm512_mullo_epi16(q1, s1), glo + at, ghi + at);
      }
    }
  }
}

// Q6_K: w = d sc_i (q - 32), sub-blocks i of 16, q 6 bits.
void unpack_q6_k(const uint8_t* w, int64_t n, int64_t nb, int64_t sb0, int64_t sb1, Group& g) {
  g.resize(sb1 - sb0);
  int8_t *const glo = g.lo.data(), *const ghi = g.hi.data();
  float* const gd = g.d.data();
  const __m256i off = _mm256_set1_epi8(32);
  for (int f = 0; f < kTile; ++f) {
    const uint8_t* row = w + (n + f) * nb * kQ6_KBytes;
    for (int64_t sb = 0; sb < sb1 - sb0; ++sb) {
      const uint8_t* b = row + (sb0 + sb) * kQ6_KBytes;
      gd[sb * kTile + f] = half_at(b + 208);
      const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
      for (int h = 0; h < 2; ++h) {  // q[c]: the codes of weights 128 h + 32 c .. + 31 (gguf's order)
        __m256i q[4];
        kvserve::q6_k_codes(b, h, q);
        __m512i v[4];
        for (int c = 0; c < 4; ++c) {  // sub-blocks i = 8h + 2c (weights 0-15) and i + 1 (16-31)
          const short i = static_cast<short>(8 * h + 2 * c);
          const __m512i s = _mm512_permutexvar_epi16(
              _mm512_inserti64x4(_mm512_set1_epi16(i), _mm256_set1_epi16(static_cast<short>(i + 1)), 1), sc);
          v[c] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_sub_epi8(q[c], off)), s);
        }
        for (int c = 0; c < 4; c += 2) {  // weights 128 h + 32 c .. + 63: chunk 2h + c / 2
          const int64_t at = ((sb * 4 + 2 * h + c / 2) * kTile + f) * 64;
          store_split(v[c], v[c + 1], glo + at, ghi + at);
        }
      }
    }
  }
}

// One super-block of a row tile: C tiles CL += lo x B and CH += hi x B over its 4 chunks of 64
// (A tiles 2, 3, B tile 4), stored to c (I_lo, then I_hi). DPH: the hi codes' product (Q6_K's are
// signed). The tile numbers are instruction operands, so each C pair is its own function.
#define KVSERVE_SUPER_PRODUCTS(NAME, CL, CH, DPH)                                      \
  inline void NAME(const int8_t* bt, const int8_t* lo, const int8_t* hi, int32_t* c) { \
    _tile_zero(CL);                                                                    \
    _tile_zero(CH);                                                                    \
    for (int ch = 0; ch < 4; ++ch) {                                                   \
      _tile_loadd(4, bt + ch * 1024, 64);                                              \
      _tile_loadd(2, lo + ch * 1024, 64);                                              \
      _tile_dpbusd(CL, 2, 4);                                                          \
      _tile_loadd(3, hi + ch * 1024, 64);                                              \
      DPH(CH, 3, 4);                                                                   \
    }                                                                                  \
    _tile_stored(CL, c, 64);                                                           \
    _tile_stored(CH, c + kTile * kTile, 64);                                           \
  }
KVSERVE_SUPER_PRODUCTS(super_products_01, 0, 1, _tile_dpbusd)
KVSERVE_SUPER_PRODUCTS(super_products_56, 5, 6, _tile_dpbusd)
KVSERVE_SUPER_PRODUCTS(super_products_q6_01, 0, 1, _tile_dpbssd)
KVSERVE_SUPER_PRODUCTS(super_products_q6_56, 5, 6, _tile_dpbssd)
#undef KVSERVE_SUPER_PRODUCTS

// Features [n, n + 16) of rows [0, M): out[r * ldo + n + f]. The weights go in slabs of kSlab
// super-blocks (16 KB unpacked, in L1 with the activations' tiles: tile loads from L2 had bound
// the kernel), each slab against every row tile.
template <int64_t kFmt>
void group_tiles(const kvserve::Q8Act& x, const uint8_t* w, int64_t n, Group& g, float* out, int64_t ldo) {
  constexpr bool kQ6 = kFmt == kQ6_K;
  constexpr int64_t kSlab = 2;
  const int64_t nb = x.K / 256, tiles = (x.M + kTile - 1) / kTile;
  constexpr int64_t kBytes = kFmt == kQ4_K ? kQ4_KBytes : kFmt == kQ5_K ? kQ5_KBytes : kQ6_KBytes;
  const uint8_t* next = w + (n + kTile) * nb * kBytes;
  g.acc.assign(tiles * kTile * kTile, 0.f), g.corr.assign(kQ6 ? 0 : tiles * kTile * kTile, 0.f);
  alignas(64) int32_t c[kSlab][2 * kTile * kTile];  // per super-block of the slab: I_lo, I_hi [feature][row]
  for (int64_t sb0 = 0; sb0 < nb; sb0 += kSlab) {
    const int64_t sb1 = std::min(nb, sb0 + kSlab);
    if (kQ6) unpack_q6_k(w, n, nb, sb0, sb1, g); else unpack_q4_k<kFmt == kQ5_K>(w, n, nb, sb0, sb1, g);
    for (int64_t o = sb0 * kTile * kBytes; o < sb1 * kTile * kBytes; o += 64)  // the next group's weights, a slice per slab
      _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
    asm volatile("" ::: "memory");  // tileloadd's asm does not name the memory it reads
    for (int64_t t = 0; t < tiles; ++t) {
      float* const acc = g.acc.data() + t * kTile * kTile;
      float* const corr = kQ6 ? nullptr : g.corr.data() + t * kTile * kTile;
      const auto bt = [&](int64_t sb) { return x.kt.data() + (t * x.K / 4 + sb * 64) * 64; };
      const auto lo = [&](int64_t s) { return g.lo.data() + s * 4 * kTile * 64; };
      const auto hi = [&](int64_t s) { return g.hi.data() + s * 4 * kTile * 64; };
      // the slab's super-blocks: the first into C tiles 0, 1 and c[0], the second into 5, 6 and c[1]
      if (kQ6) super_products_q6_01(bt(sb0), lo(0), hi(0), c[0]); else super_products_01(bt(sb0), lo(0), hi(0), c[0]);
      if (sb1 - sb0 > 1) {
        if (kQ6) super_products_q6_56(bt(sb0 + 1), lo(1), hi(1), c[1]); else super_products_56(bt(sb0 + 1), lo(1), hi(1), c[1]);
      }
      for (int64_t sb = sb0; sb < sb1; ++sb) {
        const int64_t s = sb - sb0;  // in the slab
        const int32_t* cs = c[s];
        const __m512 dx = _mm512_loadu_ps(x.ktd.data() + (t * nb + sb) * kTile);
        __m512i sums[4];
        if (!kQ6)
          for (int p = 0; p < 4; ++p) sums[p] = _mm512_loadu_si512(x.ktsum.data() + ((t * nb + sb) * 4 + p) * kTile);
        // the next tile's activations for this super-block (4 KB: 4 lines per feature step)
        const int8_t* ahead = t + 1 < tiles ? bt(sb) + x.K / 4 * 64 : nullptr;
        for (int f = 0; f < kTile; ++f) {
          if (ahead)
            for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + (4 * f + l) * 64), _MM_HINT_T0);
          const __m512i A = _mm512_add_epi32(_mm512_load_si512(cs + f * kTile),
                                             _mm512_slli_epi32(_mm512_load_si512(cs + (kTile + f) * kTile), 8));
          float* af = acc + f * kTile;
          _mm512_storeu_ps(af, _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), _mm512_mul_ps(_mm512_set1_ps(g.d[s * kTile + f]), dx),
                                               _mm512_loadu_ps(af)));
          if (!kQ6) {
            const int32_t* mins = g.mins.data() + (s * kTile + f) * 4;
            __m512i B = _mm512_dpwssd_epi32(_mm512_setzero_si512(), sums[0], _mm512_set1_epi32(mins[0]));
            for (int p = 1; p < 4; ++p) B = _mm512_dpwssd_epi32(B, sums[p], _mm512_set1_epi32(mins[p]));
            float* cf = corr + f * kTile;
            _mm512_storeu_ps(cf, _mm512_fmadd_ps(_mm512_cvtepi32_ps(B), _mm512_mul_ps(_mm512_set1_ps(g.dmin[s * kTile + f]), dx),
                                                 _mm512_loadu_ps(cf)));
          }
        }
      }
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const float* acc = g.acc.data() + t * kTile * kTile;
    const float* corr = kQ6 ? nullptr : g.corr.data() + t * kTile * kTile;
    const int64_t rows = std::min<int64_t>(kTile, x.M - t * kTile);
    const __m512i by_feature = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(kTile));
    for (int64_t r = 0; r < rows; ++r) {  // row r's 16 features: one 64-byte store
      __m512 v = _mm512_i32gather_ps(by_feature, acc + r, 4);
      if (!kQ6) v = _mm512_sub_ps(v, _mm512_i32gather_ps(by_feature, corr + r, 4));
      _mm512_storeu_ps(out + (t * kTile + r) * ldo + n, v);
    }
  }
}


// ---- Q4_1 / Q8_0 strip pairs: per 32-block one tile product C[row][column] = sum_k x[row][k]
// w[k][column] of 16 activation rows (A: Q8Act::q8 as it is, 32 bytes a row, row stride K) by
// the pair's 16 columns (B: the k-quads of relay_q4_1_pair / relay_q8_0_pair, 8 rows of 64
// bytes), signed by unsigned (Q4_1's codes) or signed (Q8_0's). C is the exact int32 dot
// product quant_linear_q8.cpp's pair_q4_1 / pair_q8_0 reach with vpdpbusd, and the float work
// after it is theirs, per row in the same order, so the outputs are theirs bit for bit. A block's
// scales (per column and per row) change every 32 k, so each product is one block (K = 32).
// Tiles: C 0, 1; A 2, 3; B 4, 5 (two blocks in flight).
void configure_strip_tiles() {
  kvserve::TileConfig c;
  for (int i = 0; i < 2; ++i) c.rows[i] = kTile, c.colsb[i] = 64;  // C: 16 rows x 16 int32
  for (int i = 2; i < 4; ++i) c.rows[i] = kTile, c.colsb[i] = 32;  // A: 16 rows x 32 codes
  for (int i = 4; i < 6; ++i) c.rows[i] = 8, c.colsb[i] = 64;      // B: 8 k-quads x 16 columns
  kvserve::load_tile_config(c);
}

// 64 bytes, 64-aligned: a B-tile row. (std::vector<__m512i> would not do: GCC drops a vector
// type's alignment in a template argument, and an unaligned buffer faults the aligned stores.)
struct alignas(64) Line {
  int8_t b[64];
};

#define KVSERVE_BLOCK_PRODUCT(NAME, C, A, B, DP)                                \
  inline void NAME(const int8_t* a, int64_t lda, const Line* b, int32_t* c) {    \
    _tile_loadd(B, b, 64);                                                      \
    _tile_loadd(A, a, lda);                                                     \
    _tile_zero(C);                                                              \
    DP(C, A, B);                                                                \
    _tile_stored(C, c, 64);                                                     \
  }
KVSERVE_BLOCK_PRODUCT(block_product_q4_1_0, 0, 2, 4, _tile_dpbsud)
KVSERVE_BLOCK_PRODUCT(block_product_q4_1_1, 1, 3, 5, _tile_dpbsud)
KVSERVE_BLOCK_PRODUCT(block_product_q8_0_0, 0, 2, 4, _tile_dpbssd)
KVSERVE_BLOCK_PRODUCT(block_product_q8_0_1, 1, 3, 5, _tile_dpbssd)
#undef KVSERVE_BLOCK_PRODUCT

// The per-32 scales and block sums of one tile of 16 activation rows, block-major ([block][row]),
// for the float work (one base pointer, constant offsets).
struct RowTileScales {
  std::vector<float> d, s;
  void fill(const kvserve::Q8Act& x, int64_t r0) {
    const int64_t nb = x.K / 32;
    d.resize(nb * kTile), s.resize(nb * kTile);
    for (int r = 0; r < kTile; ++r)
      for (int64_t b = 0; b < nb; ++b) d[b * kTile + r] = x.d[(r0 + r) * nb + b], s[b * kTile + r] = x.s[(r0 + r) * nb + b];
  }
};

// Rows [r0, r0 + 16) against the strip pair whose re-laid weights are bw (8 B-tile rows per
// block) and whose strip-blocks are at a and a + strip_bytes (kFmt: Q4_1, Q5_0 or Q8_0); out:
// their 16 columns. The products of a chunk of kChunk blocks are issued (and stored) before the
// float work of the chunk before it, which they do not wait for: a block's tile product, stored,
// then loaded into vectors, had serialized tile and vector work (~165 GMAC/s, one thread, 16 rows
// of Q4_1).
template <int64_t kFmt>
void strip_pair_tile(const kvserve::Q8Act& x, int64_t r0, const RowTileScales& sc, const Line* bw,
                     const uint8_t* a, int64_t strip_bytes, float* out, int64_t ldo) {
  constexpr bool kQ8 = kFmt == kQ8_0;
  constexpr int64_t kBytes = kvserve::blocks::strip_block_bytes(kFmt), kChunk = 8;
  const int64_t nb = x.K / 32;
  const int8_t* xa = x.q8.data() + r0 * x.K;
  alignas(64) int32_t c[2][kChunk][kTile * kTile];  // two chunks' products [block][row][column]
  const auto products = [&](int64_t c0, int32_t (*cc)[kTile * kTile]) {
    const int64_t n = std::min(kChunk, nb - c0);
    asm volatile("" ::: "memory");  // the tile asm names neither the memory it reads nor what it writes
    for (int64_t i = 0; i < n; i += 2) {
      const int64_t b = c0 + i;
      if (kQ8) block_product_q8_0_0(xa + b * 32, x.K, bw + b * 8, cc[i]);
      else block_product_q4_1_0(xa + b * 32, x.K, bw + b * 8, cc[i]);
      if (i + 1 < n) {
        if (kQ8) block_product_q8_0_1(xa + b * 32 + 32, x.K, bw + b * 8 + 8, cc[i + 1]);
        else block_product_q4_1_1(xa + b * 32 + 32, x.K, bw + b * 8 + 8, cc[i + 1]);
      }
    }
    asm volatile("" ::: "memory");
  };
  __m512 acc[kTile];
#pragma GCC unroll 16
  for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
  products(0, c[0]);
  for (int64_t c0 = 0, k = 0; c0 < nb; c0 += kChunk, k ^= 1) {
    if (c0 + kChunk < nb) products(c0 + kChunk, c[k ^ 1]);
    for (int64_t i = 0; i < std::min(kChunk, nb - c0); ++i) {
      const uint8_t *sa = a + (c0 + i) * kBytes, *sb = sa + strip_bytes;
      const __m512 d = kvserve::halves16(sa, sb);
      // Q5_0: w = d (q - 16) = d q + m with m = -16 d, as pair_nibbles takes it
      const __m512 m = kQ8 ? d : kFmt == kQ5_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-16.f)) : kvserve::halves16(sa + 16, sb + 16);
      const float *dx = sc.d.data() + (c0 + i) * kTile, *sx = sc.s.data() + (c0 + i) * kTile;
      const int32_t* cb = c[k][i];
#pragma GCC unroll 16
      for (int r = 0; r < kTile; ++r) {  // pair_nibbles / pair_q8_0's float operations
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + r * kTile)),
                                 _mm512_mul_ps(d, _mm512_set1_ps(dx[r])), acc[r]);
        if (!kQ8) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r]), acc[r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kTile; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// A strip pair's weights (strip-blocks at a and a + strip_bytes) re-laid for the B tiles, once
// for every row tile: 8 k-quads of 16 columns per block into bw.
template <int64_t kFmt>
void relay_pair(const uint8_t* a, int64_t strip_bytes, int64_t nb, std::vector<Line>& bw) {
  constexpr int64_t kBytes = kvserve::blocks::strip_block_bytes(kFmt);
  bw.resize(nb * 8);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *sa = a + b * kBytes, *sb = sa + strip_bytes;
    kvserve::prefetch_ahead(sa, kBytes), kvserve::prefetch_ahead(sb, kBytes);
    __m512i* w = reinterpret_cast<__m512i*>(bw.data() + b * 8);
    if (kFmt == kQ8_0) kvserve::relay_q8_0_pair(sa, sb, w);
    else if (kFmt == kQ5_0) kvserve::relay_q5_0_pair(sa, sb, w);
    else kvserve::relay_q4_1_pair(sa, sb, w);
  }
}

}  // namespace

int64_t kvserve::strip_pairs_amx(const Q8Act& x, const uint8_t* w, int64_t format, int64_t strip_bytes, int64_t s0,
                                 int64_t s1, float* out, int64_t ldo) {
  const int64_t rows = x.M / kTile * kTile;
  if (!kHasAmx || x.M < kAmxStripMinRows || !kvserve::blocks::is_strip_format(format)) return 0;
  thread_local std::vector<Line> bw;
  thread_local std::vector<RowTileScales> scales;
  scales.resize(rows / kTile);
  for (int64_t t = 0; t < rows / kTile; ++t) scales[t].fill(x, t * kTile);
  configure_strip_tiles();
  const auto pairs = [&](auto fmt) {
    constexpr int64_t kFmt = decltype(fmt)::value;
    for (int64_t s = s0; s + 1 < s1; s += 2) {
      const uint8_t* a = w + s * strip_bytes;
      relay_pair<kFmt>(a, strip_bytes, x.K / 32, bw);
      for (int64_t t = 0; t < rows / kTile; ++t)
        strip_pair_tile<kFmt>(x, t * kTile, scales[t], bw.data(), a, strip_bytes,
                              out + t * kTile * ldo + s * kStripColumns, ldo);
    }
  };
  if (format == kQ8_0) pairs(std::integral_constant<int64_t, kQ8_0>{});
  else if (format == kQ5_0) pairs(std::integral_constant<int64_t, kQ5_0>{});
  else pairs(std::integral_constant<int64_t, kQ4_1>{});
  _tile_release();
  return rows;
}

int64_t kvserve::kquant_rows_amx(const Q8Act& x, const uint8_t* w, int64_t format, int64_t n0, int64_t n1, float* out,
                                 int64_t ldo) {
  if (!kHasAmx || x.kt.empty() || n1 - n0 < kTile) return n0;
  thread_local Group g;
  configure_tiles();
  int64_t n = n0;
  for (; n + kTile <= n1; n += kTile) {
    if (format == kQ4_K) group_tiles<kQ4_K>(x, w, n, g, out, ldo);
    else if (format == kQ5_K) group_tiles<kQ5_K>(x, w, n, g, out, ldo);
    else group_tiles<kQ6_K>(x, w, n, g, out, ldo);
  }
  _tile_release();
  return n;
}

void kvserve::Q8Act::fill_tiles() {
  const int64_t tiles = (M + kTile - 1) / kTile, nb = K / 256;
  kt.assign(tiles * kTile * K, 0), ktd.assign(tiles * nb * kTile, 0.f), ktsum.assign(tiles * nb * 4 * kTile, 0);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = std::min<int64_t>(kTile, M - t * kTile);
    const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1);
    // dword r of the gather: row t * 16 + r's 4 codes at a K offset
    const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(K)));
    const int8_t* base = k8.data() + t * kTile * K;
    int8_t* dst = kt.data() + t * kTile * K;
    for (int64_t q = 0; q < K / 4; ++q) {  // K offset 4q: super-block, 32-block (k8_order), within it
      const int64_t k = 4 * q, sb = k / 256, j = k % 256 / 32;
      const int8_t* src = base + sb * 256 + 32 * k8_order(static_cast<int>(j)) + k % 32;
      _mm512_storeu_si512(dst + q * 64, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, src, 1));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = t * kTile + r;
      for (int64_t sb = 0; sb < nb; ++sb) {
        ktd[(t * nb + sb) * kTile + r] = kd[row * nb + sb];
        const int16_t* s16 = ksum16.data() + (row * nb + sb) * 16;
        for (int p = 0; p < 4; ++p) {  // sub-blocks 2p, 2p + 1 of 32: int16 pair (|.| <= 4064)
          const int32_t lo = s16[4 * p] + s16[4 * p + 1], hi = s16[4 * p + 2] + s16[4 * p + 3];
          ktsum[((t * nb + sb) * 4 + p) * kTile + r] = static_cast<int32_t>(static_cast<uint16_t>(lo) | (static_cast<uint32_t>(hi) << 16));
        }
      }
    }
  }
}

#pragma GCC pop_options
#else
int64_t kvserve::kquant_rows_amx(const Q8Act&, const uint8_t*, int64_t, int64_t n0, int64_t, float*, int64_t) { return n0; }
int64_t kvserve::strip_pairs_amx(const Q8Act&, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*, int64_t) {
  return 0;
}
void kvserve::Q8Act::fill_tiles() {}
#endif
