// The block matmuls' interface between their sources: the fp32-activation matmul of
// quant_linear.cpp as a plain function (gguf_linear_range) and its decoder (gguf_decode_range), for other kernels of the library
// (decode_layer.cpp) that split the output features over their own threads; the int8-activation
// matmul of quant_linear_q8.cpp (ModelConfig.activation_quant "int8": Q8Act, q8_supported,
// gguf_linear_q8_range) and its AMX entry points in quant_linear_amx.cpp; the weight prefetch
// they all use (prefetch_ahead). Included by decode_layer.cpp, quant_linear.cpp,
// quant_linear_q8.cpp and quant_linear_amx.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_features.h"  // KVSERVE_X86, <immintrin.h>

namespace at {
class Tensor;
}

namespace kvserve {

// Output features [n0, n1) of y[M, N] = x[M, K] @ W^T, W one packed matrix of `format` (the
// codes of engine/loader/gguf/blocks.py BlockFormat, as gguf_linear takes it): feature n of row r goes to
// out[r * ldo + n - n0], computed on the calling thread. For the strip formats (Q4_1, Q8_0, Q5_0) n0 must be a multiple of 8 and n1
// a multiple of 8 or N.
void gguf_linear_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t format,
                       int64_t n0, int64_t n1, float* out, int64_t ldo);

// Rows [n0, n1) of a packed matrix of `format` at weights [k0, k1) (whole blocks along K) as fp32,
// the values gguf_linear_range multiplies by: out[(n - n0) * ldo + k - k0], on the calling thread.
// For the strip formats n0 must be a multiple of 8. (prefill_linear.cpp's bf16 panels.)
// TORCH_CHECK that `packed` (gguf_pack's) holds an [N, K] matrix of `format`.
void gguf_check_packed(const at::Tensor& packed, int64_t N, int64_t K, int64_t format);

void gguf_decode_range(const uint8_t* w, int64_t K, int64_t format, int64_t n0, int64_t n1, int64_t k0, int64_t k1,
                       float* out, int64_t ldo);

// Rows of activations quantized to int8, as llama.cpp quantizes them for each weight format:
// - per 32 along K (its Q8_0/Q8_1, for Q4_1 and Q8_0 weights; layout kBlocks): block b of row r
//   has the fp32 scale d = max|x| / 127, codes q = round-half-even(x * (1 / d)) in [-127, 127]
//   (all 0 when the block is 0), and s = d * sum(q) (the block sum the offset formats need);
// - per 256 (its Q8_K, for the K-quants Q4_K and Q6_K; layout kSuper): the same rule over each
//   super-block of 256, with the code sums of each 16 kept as integers. One scale per weight
//   super-block lets the kernels sum a super-block's integer products before any float work.
// The value the kernels multiply by is d * q. The per-32 codes are held in the layouts the
// strip kernels read (see quant_linear_q8.cpp): int8 `q8` (Q4_1, Q5_0, Q8_0 on AVX2) and offset
// `u8` (Q8_0 on AVX512-VNNI); the per-256 codes as they are (`k8`, one-row kernels) and
// transposed (`kq`, many-row kernels).
struct Q8Act {
  int64_t M = 0, K = 0;
  // per 32 (kBlocks; kOffset implies it)
  std::vector<int8_t> q8;    // [M, K] the codes
  std::vector<float> d, s;   // [M, K / 32]
  std::vector<uint8_t> u8;   // [M, K] the codes + 128 (AVX512-VNNI CPUs only: the unsigned operand of vpdpbusd for Q8_0; kOffset)
  // per 256 (kSuper; K % 256 == 0)
  std::vector<int8_t> k8;      // [M, K] the codes
  std::vector<int8_t> kq;      // [M, K] the same codes, each 256 in transpose_k's order (AVX2 only)
  std::vector<int16_t> ksum16; // [M, K / 16] the sum of each 16 codes, |.| <= 2032
  std::vector<float> kd;       // [M, K / 256]
  // per 256, as AMX tiles read them (kTiles; AMX CPUs, M >= kAmxMinRows): rows in tiles of 16
  // (T = ceil(M / 16), rows past M zero), quant_linear_amx.cpp
  std::vector<int8_t> kt;      // [T, K / 4, 16, 4] each row's 4 codes at k = 4q .. 4q + 3, natural k order
  std::vector<float> ktd;      // [T, K / 256, 16] kd
  std::vector<int32_t> ktsum;  // [T, K / 256, 4, 16] the code sums of 32-blocks 2p and 2p + 1, an int16 pair
  // The layouts as a bit set: each kernel reads some of them (q8_layouts), so a call makes only
  // those (the others are left empty).
  enum Layout : unsigned { kBlocks = 1, kOffset = 4, kSuper = 8, kTiles = 16, kAll = 29 };
  // Quantize x [M, K] (row stride K, K a multiple of 32, of 256 for kSuper) into this buffer,
  // reusing its memory.
  void quantize(const float* x, int64_t M, int64_t K, unsigned layouts = kAll);
  // kt, ktd, ktsum from k8, kd, ksum16 (quant_linear_amx.cpp).
  void fill_tiles();
};

// How far ahead of the weights being read the block kernels (int8 and fp32 activations)
// prefetch them, in bytes, and into which level (_MM_HINT_T1: L2); build flags override both.
#ifndef KVSERVE_Q8_PREFETCH
#define KVSERVE_Q8_PREFETCH 8192
#endif
constexpr int64_t kWeightPrefetch = KVSERVE_Q8_PREFETCH;
#ifndef KVSERVE_Q8_PREFETCH_HINT
#define KVSERVE_Q8_PREFETCH_HINT _MM_HINT_T1
#endif

#ifdef KVSERVE_X86
// Software prefetch of the cache lines kWeightPrefetch bytes past a block about to be read: the
// weights stream from DRAM (or a far L3) once per step, and with integer dot products the kernels
// outrun the hardware prefetcher (measured on one thread over 44 MB of Q4_1: ~4.5 -> ~6.5 GB/s,
// `sum` ~7). Measured on a Sapphire Rapids VM (2 threads, native layers of a decode step): 8 KB
// ahead, not 1 KB, took SmolLM2's (its L3 holds the model but answers slowly) from ~3.7 to ~2.7 ms;
// into L2, not L1, took the 1B's (from DRAM) from ~38 to ~32 ms, SmolLM2's about even: a core has
// more L2 misses in flight than L1 fill buffers, and L2 has room for 8 KB ahead of two threads.
// The fp32-activation kernels (quant_linear.cpp, the default) expand each weight to fp32 and
// were further still behind the stream: with the prefetch a one-row step of SmolLM2 Q4_1 went
// from 16-18 to 6.7-6.9 ms, of the 1B Q4_K_M from 98-101 to 66 ms (same VM, bench.probes.step_profile).
inline void prefetch_range(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), KVSERVE_Q8_PREFETCH_HINT);
}
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) { prefetch_range(p + kWeightPrefetch, bytes); }
#endif

// The fewest rows for which the K-quants' int8 matmul takes AMX tiles (a tile multiply costs the
// same for 1 row as for 16). Since the AVX-512 kernels took 16 rows a pass (zmm lanes), they beat
// the tiles below 32 rows: the 1B Q4_K_M's layer matmuls at 16 / 24 rows 10-15% / 12-25% faster
// (2 threads), its 16-row decode step ~4% (docs/benchmarks.md, "a twentieth session"); from 32
// rows the tiles win on Q6_K and the LM head and, from a few hundred rows (prefill), on all.
// A build flag overrides it (-DKVSERVE_AMX_MIN_ROWS=16), for measuring.
#ifndef KVSERVE_AMX_MIN_ROWS
#define KVSERVE_AMX_MIN_ROWS 32
#endif
constexpr int64_t kAmxMinRows = KVSERVE_AMX_MIN_ROWS;
// The fewest rows for which the Q4_1 / Q5_0 / Q8_0 strip pairs take AMX tiles. Their 32-blocks
// are one tile product each, stored and scaled per block, and once the strips' codes came in
// k-quads (block_codes.h) the vpdpbusd pair kernels beat the tiles at 16 rows: SmolLM2's layers
// ~226-270 against ~254-310 us, its Q8_0 LM head ~1.3-1.6 against ~1.9-2.2 ms, a 16-row decode step
// ~7% (2 threads, this project's Sapphire Rapids VM); about even at 24 rows; from 32 the tiles win
// (~420 against ~460 us, 2.5 against 3.0 ms).
constexpr int64_t kAmxStripMinRows = 32;

// Output features [n0, n0 + 16 g) of the K-quant `format` (Q4_K, Q5_K, Q6_K) for every row of x,
// on AMX tiles, g the whole groups of 16 in [n0, n1): out[r * ldo + n]. Returns n0 + 16 g, where
// the caller's own kernel goes on (n0 itself where x has no tile layout or the CPU no AMX).
int64_t kquant_rows_amx(const Q8Act& x, const uint8_t* w, int64_t format, int64_t n0, int64_t n1, float* out,
                        int64_t ldo);

// Q4_1, Q5_0 or Q8_0 (`format`): strips [s0, s1), all full and an even count, as pairs (s0, s0 + 1),
// ... (quant_linear_q8.cpp's strips_q8 chooses them), for rows [0, 16 t) of x on AMX tiles, t the
// whole 16-row tiles of x; strip s's columns at out + s * 8 (row stride ldo). Returns 16 t: the
// rows done (0 where the CPU has no AMX or x fewer than kAmxStripMinRows rows); the caller runs the
// rest on its own kernels, which give the same floats.
int64_t strip_pairs_amx(const Q8Act& x, const uint8_t* w, int64_t format, int64_t strip_bytes, int64_t s0, int64_t s1,
                        float* out, int64_t ldo);

// Q8Act::k8 holds each 256 codes as its 32-blocks in the order [0, 2, 1, 3, 4, 6, 5, 7]: the
// 512-bit one-row kernels read blocks [4c | 4c + 2] and [4c + 1 | 4c + 3] as one 64-byte load each.
// Position of block j (its own inverse).
constexpr int k8_order(int j) { return (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1); }

// The Q8Act layouts the int8 kernel of `format` reads on this CPU (0 where it has none).
unsigned q8_layouts(int64_t format);

// Whether gguf_linear_q8_range runs `format` on this CPU (AVX2 and a format it has a kernel
// for); where not, callers multiply the fp32 activations (gguf_linear_range).
bool q8_supported(int64_t format);

// As gguf_linear_range, with the activations quantized (Q8Act) and integer dot products per
// block; requires q8_supported(format).
void gguf_linear_q8_range(const Q8Act& x, const uint8_t* w, int64_t N, int64_t format, int64_t n0, int64_t n1,
                          float* out, int64_t ldo);

}  // namespace kvserve
