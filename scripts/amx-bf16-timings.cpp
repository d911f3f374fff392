// What one AMX-BF16 operation costs here, as the prefill attention kernel issues them
// (engine/kernels/cpu/prefill_attention.cpp): a tile product (TDPBF16PS, 16 x 16 x 32) into four
// independent accumulators or twice into one, a B-tile load before each product, and plain tile
// loads and stores, in ns each over 10^6 rounds on one thread:
//
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 scripts/amx-bf16-timings.cpp -o /tmp/amx-bf16 && /tmp/amx-bf16
//
// Needs an AMX-BF16 CPU (Sapphire Rapids or later) and GCC 11+. Not part of the kernels' build.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "../engine/kernels/cpu/amx_tiles.h"  // configure_full_tiles (the kernels' own)

namespace {

alignas(64) uint16_t tiles[8][512];  // bf16 1.0 everywhere
alignas(64) float out[4][256];
constexpr int kRounds = 1000000;

template <typename F>
double ns_each(F&& body, int per_round) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kRounds; ++i) body(i);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (double(kRounds) * per_round);
}

}  // namespace

int main() {
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // <asm/prctl.h>, XFEATURE_XTILEDATA
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) {
    std::puts("no permission to use AMX tile data here");
    return 1;
  }
  kvserve::configure_full_tiles();
  for (auto& t : tiles)
    for (auto& v : t) v = 0x3f80;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, tiles[0], 64); _tile_loadd(5, tiles[1], 64); _tile_loadd(6, tiles[2], 64); _tile_loadd(7, tiles[3], 64);
  std::printf("product, 4 accumulators:     %.2f ns\n", ns_each([](int) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }, 4));
  std::printf("product, 1 accumulator:      %.2f ns\n", ns_each([](int) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 7);
  }, 2));
  std::printf("B-tile load + product, 4 acc: %.2f ns\n", ns_each([](int i) {
    _tile_loadd(6, tiles[2 + (i & 3)], 64); _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, tiles[3], 64); _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, tiles[4], 64); _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, tiles[5], 64); _tile_dpbf16ps(3, 5, 7);
  }, 4));
  std::printf("tile store:                  %.2f ns\n", ns_each([](int) {
    _tile_stored(0, out[0], 64); _tile_stored(1, out[1], 64); _tile_stored(2, out[2], 64); _tile_stored(3, out[3], 64);
  }, 4));
  std::printf("tile load:                   %.2f ns\n", ns_each([](int) {
    _tile_loadd(4, tiles[0], 64); _tile_loadd(5, tiles[1], 64); _tile_loadd(6, tiles[2], 64); _tile_loadd(7, tiles[3], 64);
  }, 4));
  _tile_release();
  return 0;
}
