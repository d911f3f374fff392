// What the AMX tile kernels (quant_linear_amx.cpp, prefill_attention.cpp) share: KVSERVE_AMX where
// the compiler has the AMX intrinsics (GCC 11, clang 12; with an older one the kernels are left
// out), and the tile configuration ldtilecfg loads. Whether the CPU runs them is cpu_has_amx's
// answer (cpu_features.h), at run time.
#pragma once

#include <cstdint>

#include "cpu_features.h"  // KVSERVE_X86, <immintrin.h>

#if defined(KVSERVE_X86) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define KVSERVE_AMX 1

namespace kvserve {

// ldtilecfg's 64-byte operand, palette 1: each tile's rows and bytes per row (at most 16 x 64).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tile shapes from c, until the next load or _tile_release.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& c) {
  asm volatile("" ::: "memory");  // ldtilecfg's asm names only 8 bytes of c as its input
  _tile_loadconfig(&c);
}

// All eight tiles 16 rows x 64 bytes.
__attribute__((target("amx-tile"))) inline void configure_full_tiles() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  load_tile_config(c);
}

}  // namespace kvserve
#endif
