// What bounds the AMX strip-pair kernel (engine/kernels/cpu/quant_linear_amx.cpp strip_pair_tile):
// per-32 block scales on both sides (Q4_1 / Q8_0 weights, Q8 activations) mean one 16 x 16 x 32
// tile product per block, stored to memory, then 16 rows of float work (cvt, the outer product of
// the scales, two FMAs). This times that loop and its parts on random data of the gate/up shape
// (512 rows x 3072 columns x K 576), one thread, in cycles per block tile (8,192 multiply-adds)
// at the nominal clock given (default 3 GHz; only ratios between the lines matter):
//
//   g++ -O3 -march=native scripts/amx-strip-tiles.cpp -o /tmp/amx-strip-tiles && /tmp/amx-strip-tiles [GHz]
//
// Needs an AMX-INT8 CPU (Sapphire Rapids or later) and GCC 11+. Not part of the kernels' build.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../engine/kernels/cpu/amx_tiles.h"  // TileConfig, load_tile_config (the kernels' own)

namespace {

constexpr int kK = 576, kBlocks = kK / 32, kRows = 512, kCols = 3072;

struct alignas(64) Line {
  int8_t b[64];
};

void configure() {  // C 0..3: 16 x 16 int32; A 4, 5: 16 rows x 32 codes; B 6, 7: 8 k-quads x 16 columns
  kvserve::TileConfig c;
  for (int i = 0; i < 4; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  for (int i = 4; i < 6; ++i) c.rows[i] = 16, c.colsb[i] = 32;
  for (int i = 6; i < 8; ++i) c.rows[i] = 8, c.colsb[i] = 64;
  kvserve::load_tile_config(c);
}

struct Data {
  std::vector<int8_t> x = std::vector<int8_t>(kRows * kK);
  std::vector<Line> w = std::vector<Line>(kBlocks * 8);
  std::vector<float> dx = std::vector<float>(kRows * kBlocks, 0.01f), sx = std::vector<float>(kRows * kBlocks, 0.02f);
  std::vector<uint16_t> scales = std::vector<uint16_t>(kBlocks * 32, 0x2000);  // fp16 d and m of 16 columns
};

// The float work of one block for 16 rows: the kernel's own (pair_nibbles' operations).
inline void float_work(const int32_t* c, const uint16_t* dm, const float* dx, const float* sx, __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 16)));
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * 16)), _mm512_mul_ps(d, _mm512_set1_ps(dx[r])),
                             acc[r]);
    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r]), acc[r]);
  }
}

// One row tile against one strip pair, the kernel's shape: the products of a chunk of 8 blocks
// (two C tiles in turn) issued before the float work of the chunk before. kProducts / kFloat
// leave either part out; kStale makes the float work read a buffer the products do not write.
template <bool kProducts, bool kFloat, bool kStale = false>
void row_tile(const Data& a, int t, float* out) {
  constexpr int kChunk = 8;
  alignas(64) static int32_t c[2][kChunk][256], stale[kChunk][256];
  const int8_t* xa = a.x.data() + t * 16 * kK;
  const auto products = [&](int c0, int32_t (*cc)[256]) {
    asm volatile("" ::: "memory");
    for (int i = 0; i < kChunk && c0 + i < kBlocks; ++i) {
      const int b = c0 + i;
      if (i % 2 == 0) {
        _tile_loadd(6, a.w.data() + b * 8, 64); _tile_loadd(4, xa + b * 32, kK); _tile_zero(0);
        _tile_dpbsud(0, 4, 6); _tile_stored(0, cc[i], 64);
      } else {
        _tile_loadd(7, a.w.data() + b * 8, 64); _tile_loadd(5, xa + b * 32, kK); _tile_zero(1);
        _tile_dpbsud(1, 5, 7); _tile_stored(1, cc[i], 64);
      }
    }
    asm volatile("" ::: "memory");
  };
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  if (kProducts) products(0, c[0]);
  for (int c0 = 0, k = 0; c0 < kBlocks; c0 += kChunk, k ^= 1) {
    if (kProducts && c0 + kChunk < kBlocks) products(c0 + kChunk, c[k ^ 1]);
    if (!kFloat) continue;
    for (int i = 0; i < kChunk && c0 + i < kBlocks; ++i) {
      const int b = c0 + i;
      float_work(kStale ? stale[i] : c[k][i], a.scales.data() + b * 32, a.dx.data() + (t * kBlocks + b) * 16,
                 a.sx.data() + (t * kBlocks + b) * 16, acc);
    }
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(out + r * 16, acc[r]);
}

// Two row tiles by two strip pairs (four C tiles, each B tile loaded once for two products),
// products a chunk of 2 blocks ahead, the float work per C tile with its sums in memory.
template <bool kFloat>
void four_tiles(const Data& a, int t, float* sums) {
  constexpr int kChunk = 2;
  alignas(64) static int32_t c[2][kChunk][4][256];
  const int8_t* xa = a.x.data() + t * 16 * kK;
  const auto products = [&](int c0, int32_t (*cc)[4][256]) {
    asm volatile("" ::: "memory");
    for (int i = 0; i < kChunk && c0 + i < kBlocks; ++i) {
      const int b = c0 + i;
      _tile_loadd(6, a.w.data() + b * 8, 64); _tile_loadd(7, a.w.data() + b * 8, 64);
      _tile_loadd(4, xa + b * 32, kK); _tile_loadd(5, xa + 16 * kK + b * 32, kK);
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      _tile_dpbsud(0, 4, 6); _tile_dpbsud(1, 4, 7); _tile_dpbsud(2, 5, 6); _tile_dpbsud(3, 5, 7);
      _tile_stored(0, cc[i][0], 64); _tile_stored(1, cc[i][1], 64); _tile_stored(2, cc[i][2], 64);
      _tile_stored(3, cc[i][3], 64);
    }
    asm volatile("" ::: "memory");
  };
  std::fill(sums, sums + 4 * 256, 0.f);
  products(0, c[0]);
  for (int c0 = 0, k = 0; c0 < kBlocks; c0 += kChunk, k ^= 1) {
    if (c0 + kChunk < kBlocks) products(c0 + kChunk, c[k ^ 1]);
    if (!kFloat) continue;
    for (int q = 0; q < 4; ++q) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_loadu_ps(sums + q * 256 + r * 16);
      for (int i = 0; i < kChunk && c0 + i < kBlocks; ++i) {
        const int b = c0 + i, rt = t + q / 2;
        float_work(c[k][i][q], a.scales.data() + b * 32, a.dx.data() + (rt * kBlocks + b) * 16,
                   a.sx.data() + (rt * kBlocks + b) * 16, acc);
      }
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(sums + q * 256 + r * 16, acc[r]);
    }
  }
}

template <class F>
double best_seconds(F&& f) {
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const double ghz = argc > 1 ? std::atof(argv[1]) : 3.0;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // Linux grants tile data per process on request
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) {
    std::printf("no AMX tile data permission (not an AMX CPU, or an old kernel)\n");
    return 1;
  }
  Data a;
  for (auto& v : a.x) v = static_cast<int8_t>(std::rand());
  for (auto& l : a.w)
    for (auto& v : l.b) v = static_cast<int8_t>(std::rand());
  alignas(64) static float out[kRows * 16 * 4];
  configure();
  const double tiles = double(kRows) * kCols * kK / 8192;
  const auto report = [&](const char* name, double s) {
    std::printf("%-58s %6.2f ms  %4.0f GMAC/s  %4.0f cycles / block tile\n", name, s * 1e3, tiles * 8192 / s / 1e9,
                s * ghz * 1e9 / tiles);
  };
  const auto pairs = [&](auto tile) {
    return best_seconds([&] {
      for (int p = 0; p < kCols / 16; ++p)
        for (int t = 0; t < kRows / 16; ++t) tile(t, out + t * 256);
    });
  };
  report("the kernel's loop (products a chunk ahead, then float work)",
         pairs([&](int t, float* o) { row_tile<true, true>(a, t, o); }));
  report("  its tile products alone (load A, B; zero; dot; store C)",
         pairs([&](int t, float* o) { row_tile<true, false>(a, t, o); }));
  report("  its float work alone", pairs([&](int t, float* o) { row_tile<false, true>(a, t, o); }));
  report("  both, the float work reading a buffer no product writes",
         pairs([&](int t, float* o) { row_tile<true, true, true>(a, t, o); }));
  const auto quads = [&](auto tile) {
    return best_seconds([&] {
      for (int p = 0; p < kCols / 32; ++p)
        for (int t = 0; t < kRows / 16; t += 2) tile(t, out + t * 256);
    });
  };
  report("four C tiles (2 row tiles x 2 strip pairs), products 2 ahead",
         quads([&](int t, float* o) { four_tiles<true>(a, t, o); }));
  report("  their tile products alone", quads([&](int t, float* o) { four_tiles<false>(a, t, o); }));
  _tile_release();
  return 0;
}
