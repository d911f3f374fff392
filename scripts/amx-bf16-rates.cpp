// What bounds a bf16 AMX matmul on this CPU (engine/kernels/cpu/prefill_linear.cpp's tile loop):
// TSC cycles per TDPBF16PS alone (16 x 16 x 32, 8,192 multiply-adds), per 1 KB TILELOADD alone
// (from L1), per load beside two products that do not read its tile (do they overlap?), and per
// product in the kernel's 2 x 2 block (2 weight tiles, 2 activation tiles, 4 accumulators: 4 loads
// per 4 products) over a K of 576 held in L1 (docs/benchmarks.md, the eighth session):
//
//   g++ -O2 -march=native scripts/amx-bf16-rates.cpp -o /tmp/amx-bf16-rates
//   for c in 0 1; do taskset -c $c /tmp/amx-bf16-rates; done
//
// Needs AMX-BF16 (Sapphire Rapids or later) and Linux's permission for tile data, asked here. Not
// part of the kernels' build.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kN = 200000;

__attribute__((target("amx-tile,amx-bf16"), noinline)) double products() {
  const uint64_t t0 = __rdtsc();
  for (int i = 0; i < kN; ++i) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  return double(__rdtsc() - t0) / (4.0 * kN);
}

__attribute__((target("amx-tile"), noinline)) double loads(const uint16_t* a) {
  const uint64_t t0 = __rdtsc();
  for (int i = 0; i < kN; ++i) {
    _tile_loadd(4, a + (i % 8) * 32, 512);
    _tile_loadd(5, a + ((i + 3) % 8) * 32, 512);
  }
  return double(__rdtsc() - t0) / (2.0 * kN);
}

__attribute__((target("amx-tile,amx-bf16"), noinline)) double load_beside_products(const uint16_t* a) {
  const uint64_t t0 = __rdtsc();
  for (int i = 0; i < kN; ++i) {
    _tile_loadd(4, a + (i % 8) * 32, 512);
    _tile_dpbf16ps(0, 5, 6); _tile_dpbf16ps(1, 5, 7);
  }
  return double(__rdtsc() - t0) / kN;
}

// The kernel's order (prefill_linear.cpp multiply): A4 B6 p0 B7 p1 A5 p2 p3.
__attribute__((target("amx-tile,amx-bf16"), noinline)) double block_2x2(const uint16_t* a, const uint16_t* b, int k) {
  const int chunks = k / 32, reps = kN / chunks;
  const uint16_t* a1 = a + 16 * k;
  const uint64_t t0 = __rdtsc();
  for (int r = 0; r < reps; ++r)
    for (int c = 0; c < chunks; ++c) {
      _tile_loadd(4, a + c * 32, k * 2);
      _tile_loadd(6, b + c * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + (chunks + c) * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a1 + c * 32, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  return double(__rdtsc() - t0) / (4.0 * reps * chunks);
}

}  // namespace

int main() {
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) {
    std::puts("no AMX tile data permission (not an AMX CPU, or an old kernel)");
    return 1;
  }
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.rows[i] = 16, config.colsb[i] = 64;
  _tile_loadconfig(&config);
  const int k = 576;
  std::vector<uint16_t> a(32 * k, 0x3f80), b(2 * (k / 32) * 512, 0x3f80);  // bf16 1.0
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a.data(), 64); _tile_loadd(5, a.data(), 64); _tile_loadd(6, b.data(), 64); _tile_loadd(7, b.data(), 64);
  for (int round = 0; round < 3; ++round)
    std::printf("TSC cycles: product %.1f | load %.1f | load + 2 products %.1f | 2x2 block, per product %.1f\n",
                products(), loads(a.data()), load_beside_products(a.data()), block_2x2(a.data(), b.data(), k));
  _tile_release();
  return 0;
}
